/**
 * Unit tests of the side panel's model logic and of the chart's history columns
 * (node's own test runner; `npm test` bundles this file with esbuild and runs it).
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { History, ema } from '../src/chart/history';
import { describeExcluded, describeQueued, isEnded, sliderMax } from '../src/common/snapshot';
import { statusLine } from '../src/widget/view';
import { HistoryCursor, RunList, describeLease, describeSlots, fingerprint, sparklinePoints } from '../src/panel/model';
import { life, run } from './fixtures';

test('the panel backs off only from a quiet list of ended runs', () => {
  const list = new RunList();
  list.apply([run({ id: 'a', state: 'stopped' })], list.begin());
  assert.ok(!list.apply([run({ id: 'a', state: 'stopped' })], list.begin()));
  list.apply([run({ id: 'b' })], list.begin());
  assert.ok(list.apply([run({ id: 'b' })], list.begin())); // a run being stopped shows no step
});

test('fingerprint changes with step and sizes only', () => {
  const a = fingerprint([run({})]);
  assert.equal(fingerprint([run({ loss: 0.5 })]), a);
  assert.notEqual(fingerprint([run({ step: 11 })]), a);
  assert.notEqual(fingerprint([run({ requested_size: 3 })]), a);
  assert.notEqual(fingerprint([run({ resize: life(1, 2, 0) })]), a); // a resize under way
});

test('a poll answer that left before a write answered is dropped: no dismissed run comes back', () => {
  const list = new RunList();
  assert.ok(list.apply([run({ id: 'a', state: 'finished' }), run({ id: 'b' })], list.begin()));
  // no change, but b trains (or is being stopped): no back-off
  assert.ok(list.apply([run({ id: 'a', state: 'finished' }), run({ id: 'b' })], list.begin()));
  const token = list.begin(); // a poll starts ...
  list.remove('a'); // ... the dismiss answers ...
  assert.ok(list.apply([run({ id: 'a', state: 'finished' }), run({ id: 'b' })], token)); // ... then the poll: stale
  assert.deepEqual(list.runs.map(r => r.id), ['b']);
  const next = list.begin();
  list.upsert(run({ id: 'b', requested_size: 3 })); // a resize's answer
  list.apply([run({ id: 'b', requested_size: 2 })], next);
  assert.equal(list.find('b')!.requested_size, 3); // the slider does not jump back
  list.apply([run({ id: 'b', requested_size: 3 })], list.begin());
  assert.equal(list.find('b')!.requested_size, 3);
});

test('ended runs can be dismissed; active and unresponsive ones cannot', () => {
  assert.deepEqual(['finished', 'failed', 'stopped', 'lost'].map(state => isEnded(run({ state: state as any }))), [true, true, true, true]);
  assert.deepEqual(['starting', 'training', 'resizing', 'unresponsive'].map(state => isEnded(run({ state: state as any }))), [false, false, false, false]);
});

test('history cursor appends pages, skips repeats and refetches after a rollback', () => {
  const c = new HistoryCursor();
  const page = (steps: number[], events: HistoryCursor['events'] = [], eventsSince = 0) => ({
    columns: ['step', 'loss', 'world_size'],
    data: [steps, steps.map(s => 1 / s), steps.map(() => 2)],
    events,
    next: { since: steps.length ? steps[steps.length - 1] : c.since, events_since: eventsSince + events.length }
  });
  assert.ok(c.apply(page([1, 2, 3])));
  assert.equal(c.since, 3);
  assert.ok(!c.apply(page([2, 3]))); // overlap: nothing new
  assert.ok(c.apply(page([4, 5, 6])));
  assert.deepEqual(c.history.column('step'), [1, 2, 3, 4, 5, 6]);
  c.apply(page([7, 8], [{ kind: 'fault', step: 8, rolled_back_to: 4 }]));
  assert.deepEqual(c.history.column('step'), [1, 2, 3, 4]);
  assert.equal(c.since, 4); // steps 5.. are fetched again
  assert.equal(c.eventsSince, 1);
  c.apply(page([5, 6, 7], [], 1));
  assert.deepEqual(c.history.column('step'), [1, 2, 3, 4, 5, 6, 7]);
});

test('binary appends decode little-endian float64 with NaN as a gap, from unaligned buffers', () => {
  const h = new History();
  const raw = new ArrayBuffer(1 + 16);
  const view = (offset: number) => new DataView(raw, offset, 16);
  new DataView(raw).setFloat64(1, 1, true);
  new DataView(raw).setFloat64(9, 2, true);
  h.appendBinary(['step'], [view(1)]);
  const vals = new ArrayBuffer(16);
  new DataView(vals).setFloat64(0, 3, true);
  new DataView(vals).setFloat64(8, NaN, true);
  h.appendBinary(['step', 'val_loss'], [new DataView(new Float64Array([3, 4]).buffer), new DataView(vals)]);
  assert.deepEqual(h.column('step'), [1, 2, 3, 4]);
  assert.deepEqual(h.column('val_loss'), [null, null, 3, null]);
  assert.deepEqual(h.metricNames, ['val_loss']);
});

test('an append that assumes rows this view lacks is refused, so the view asks for them', () => {
  const h = new History();
  h.load(['step', 'loss'], [[1, 2, 3], [1, 1, 1]]);
  assert.equal(h.appendColumns(['step', 'loss'], [[9, 10], [1, 1]], 8), -1);
  assert.equal(h.lastStep, 3);
  assert.equal(h.appendColumns(['step', 'loss'], [[4, 5], [1, 1]], 3), 2);
  assert.equal(h.appendColumns(['step', 'loss'], [[3, 4, 5, 6], [1, 1, 1, 1]], 2), 1); // overlap
  assert.deepEqual(h.column('step'), [1, 2, 3, 4, 5, 6]);
});

test('zoom detail replaces a decimated span with full-resolution rows', () => {
  const h = new History();
  h.load(['step', 'loss'], [[1, 50, 100], [1, 0.5, 0.1]]);
  const steps = Float64Array.from({ length: 51 }, (_, i) => 30 + i);
  h.spliceRange(30, 80, ['step', 'loss'], [new DataView(steps.buffer), new DataView(steps.map(s => 1 / s).buffer)]);
  assert.equal(h.length, 2 + 51);
  assert.equal(h.rowsIn(30, 80), 51);
  assert.deepEqual(h.column('step').slice(0, 3), [1, 30, 31]);
});

test('smoothing matches the Python side: debiased, gaps kept', () => {
  assert.deepEqual(ema([2, null, 2, 2], 0.9).map(v => (v === null ? null : +v.toFixed(12))), [2, null, 2, 2]);
});

test('slots and sparkline read well', () => {
  assert.equal(describeSlots(['cpu', 'cpu']), '2 CPU slots');
  assert.equal(describeSlots(['cuda:0', 'cuda:2']), 'GPU 0, 2');
  assert.equal(sparklinePoints([1], 80, 20), '');
  const pts = sparklinePoints([3, 2, 1], 80, 20).split(' ');
  assert.equal(pts.length, 3);
  assert.equal(pts[0], '0.0,1.0'); // the highest loss at the top
});

test('in lease mode the slider reaches what the arbiter can grant, never below the world size', () => {
  const lease = { auto: false, weight: 1, slots: [0, 2], standby: [], target: 2, queued: null, grantable: 3 };
  assert.equal(sliderMax(run({ max_size: 4, world_size: 2 })), 4); // no arbiter: the pool's bounds
  assert.equal(sliderMax(run({ max_size: 4, world_size: 2, lease })), 3);
  assert.equal(sliderMax(run({ max_size: 4, world_size: 2, lease: { ...lease, grantable: 1 } })), 2);
  assert.equal(sliderMax(run({ max_size: 2, world_size: 2, lease: { ...lease, grantable: 4 } })), 2);
  assert.equal(describeLease(lease), 'manual · slots 0, 2 · up to 3 now');
  assert.equal(describeLease({ ...lease, auto: true, weight: 2, slots: [], queued: 1 }),
    'auto ×2 · slots none · up to 3 now · queued #1');
  assert.equal(describeLease({ ...lease, slots: [0], lent: [{ slot: 2, to: 'run-x', user: 'bob' }] }),
    'manual · slots 0 · up to 3 now · slot 2 lent to bob/run-x; back when you train');
  assert.notEqual(fingerprint([run({ lease })]), fingerprint([run({ lease: { ...lease, auto: true } })]));
});

test('engines waiting in a scheduler\'s queue show with its reason, and redraw the panel', () => {
  const queued = ['slot 2: job 41 pending (Resources)'];
  assert.equal(describeQueued(run({})), '');
  assert.equal(describeQueued(run({ queued })), 'in the queue: slot 2: job 41 pending (Resources)');
  assert.ok(statusLine(run({ queued })).endsWith(' · in the queue: slot 2: job 41 pending (Resources)'));
  assert.notEqual(fingerprint([run({})]), fingerprint([run({ queued })]));
});

test('slots left out show why and when they come back, and redraw the panel', () => {
  const excluded = [{ slot: 1, reason: '3 faults within 60 s', until: 1000 }, { slot: 3, reason: 'its engine failed to start', until: null }];
  assert.equal(describeExcluded(run({}), 0), '');
  assert.equal(describeExcluded(run({ excluded }), 975_400),
    'slot 1 left out (3 faults within 60 s), back in 25 s; slot 3 left out (its engine failed to start), stays out');
  assert.equal(describeExcluded(run({ excluded }), 2_000_000).split(';')[0], 'slot 1 left out (3 faults within 60 s), back in 0 s');
  assert.ok(statusLine(run({ excluded })).includes(' · slot 1 left out (3 faults within 60 s)'));
  assert.notEqual(fingerprint([run({})]), fingerprint([run({ excluded })]));
});
