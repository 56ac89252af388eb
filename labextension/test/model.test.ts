/**
 * Unit tests of the side panel's model logic and of the chart's history columns
 * (node's own test runner; `npm test` bundles this file with esbuild and runs it).
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { History, ema } from '../src/chart/history';
import { Backoff, HistoryCursor, ResizeTracker, RunModel, describeSlots, fingerprint, sparklinePoints } from '../src/panel/model';

function run(fields: Partial<RunModel>): RunModel {
  return {
    id: 'r-1', name: 'digits', notebook: 'q.ipynb', state: 'training', step: 10, total_steps: 100,
    world_size: 2, requested_size: 2, min_size: 1, max_size: 4, loss: 1, recent_loss: [], slots: [],
    checkpoints: [], error: null, ...fields
  };
}

test('a resize is pending until the world size reaches the target, then done with its latency', () => {
  const t = new ResizeTracker();
  t.request(3, 1000);
  assert.equal(t.update(run({ requested_size: 3 }), 1500).kind, 'pending');
  const done = t.update(run({ world_size: 3, requested_size: 3 }), 3200);
  assert.equal(done.kind, 'done');
  assert.match(done.text, /done in 2\.2 s/);
  assert.equal(t.update(run({ world_size: 3, requested_size: 3 }), 9000).kind, 'done'); // stays shown
});

test('a later request from another tab wins and this view says so', () => {
  const t = new ResizeTracker();
  t.request(3, 0);
  assert.equal(t.update(run({ requested_size: 3 }), 500).kind, 'pending');
  const fb = t.update(run({ requested_size: 1 }), 2500);
  assert.equal(fb.kind, 'superseded');
  assert.match(fb.text, /asked for 1/);
});

test('a resize of a run that ended fails with the state; a refused request shows its reason', () => {
  const t = new ResizeTracker();
  t.request(3, 0);
  assert.equal(t.update(run({ state: 'finished' }), 100).kind, 'failed');
  t.request(9, 0);
  t.fail('pool size 9 is outside this pool\'s bounds [1, 4]');
  assert.match(t.update(run({}), 100).text, /bounds \[1, 4\]/);
});

test('requests made elsewhere show as pending too', () => {
  const t = new ResizeTracker();
  assert.equal(t.update(run({ requested_size: 3 }), 0).kind, 'pending');
  assert.equal(t.update(run({}), 0).kind, 'none');
});

test('polls back off while nothing changes and after errors, and snap back on change', () => {
  const b = new Backoff(1000, 10_000);
  assert.equal(b.next(false, false), 1500);
  assert.equal(b.next(false, false), 2250);
  assert.equal(b.next(false, true), 4500);
  for (let i = 0; i < 10; i++) {
    b.next(false, true);
  }
  assert.equal(b.next(false, false), 10_000);
  assert.equal(b.next(true, false), 1000);
});

test('fingerprint changes with step and sizes only', () => {
  const a = fingerprint([run({})]);
  assert.equal(fingerprint([run({ loss: 0.5 })]), a);
  assert.notEqual(fingerprint([run({ step: 11 })]), a);
  assert.notEqual(fingerprint([run({ requested_size: 3 })]), a);
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
