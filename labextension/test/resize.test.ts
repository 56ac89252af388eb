/**
 * The resize tracker the panel and the dashboard share: every transition of a request's
 * feedback (pending, done, already, superseded, failed) against the snapshots a view sees.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { ResizeTracker } from '../src/common/resize';
import { life, run } from './fixtures';

test('pending until the first step at the new size, then done with the run\'s own latency', () => {
  const t = new ResizeTracker();
  assert.ok(t.request(3, run(), 1000));
  assert.equal(t.pending, 3);
  assert.equal(t.update(run({ requested_size: 3 }), 1500).kind, 'pending'); // acknowledged
  // the generation ended and the new one has 3 ranks, but no step at 3 completed yet
  assert.equal(t.update(run({ world_size: 3, requested_size: 3, resize: life(2, 3, 100) }), 2000).kind, 'pending');
  const done = t.update(run({ world_size: 3, requested_size: 3, resize: life(2, 3, 100, 1.234) }), 3200);
  assert.equal(done.kind, 'done');
  assert.equal(done.latency_s, 1.234);
  assert.deepEqual([done.from, done.to], [2, 3]);
  assert.match(done.text, /world size 3: done in 1\.2 s/);
  assert.equal(t.pending, null);
  assert.equal(t.update(run({ world_size: 3, requested_size: 3, resize: life(2, 3, 100, 1.234) }), 9000).kind, 'done'); // stays shown
});

test('without the run\'s measure (an older server) done shows the time seen in the view', () => {
  const t = new ResizeTracker();
  t.request(3, run(), 1000);
  assert.equal(t.update(run({ requested_size: 3 }), 1500).kind, 'pending');
  const done = t.update(run({ world_size: 3, requested_size: 3 }), 3200);
  assert.equal(done.kind, 'done');
  assert.match(done.text, /done in 2\.2 s/);
  assert.equal(done.from, 2);
});

test('a resize life from before the request is not this request\'s latency', () => {
  const t = new ResizeTracker();
  // the run went 2 -> 3 earlier, then a fault took it back to 2; `resize` still tells of 2 -> 3
  const earlier = life(2, 3, 40, 0.7);
  t.request(3, run({ resize: earlier }), 1000);
  const done = t.update(run({ world_size: 3, requested_size: 3, resize: earlier }), 4000);
  assert.equal(done.kind, 'done');
  assert.match(done.text, /done in 3\.0 s/); // measured here
});

test('a request for the size the run has and keeps says "already N" and sends nothing', () => {
  const t = new ResizeTracker();
  assert.equal(t.request(2, run(), 0), false);
  assert.equal(t.pending, null);
  const fb = t.update(run(), 10);
  assert.equal(fb.kind, 'already');
  assert.equal(fb.text, 'already 2');
  // the same size while the run is changing away from it is a real request
  assert.ok(t.request(2, run({ requested_size: 3 }), 0));
  assert.ok(t.request(3, run({ world_size: 3, requested_size: 3, resize: life(2, 3, 1) }), 0)); // no step at 3 yet
});

test('after the run acknowledged the request, another size in requested_size supersedes it', () => {
  const t = new ResizeTracker();
  t.request(3, run(), 0);
  assert.equal(t.update(run({ requested_size: 3 }), 500).kind, 'pending');
  const fb = t.update(run({ requested_size: 1 }), 600);
  assert.equal(fb.kind, 'superseded');
  assert.match(fb.text, /asked for 1/);
  assert.equal(t.pending, null);
});

test('a newer request even back to the old size wins once this one was acknowledged', () => {
  const t = new ResizeTracker();
  t.request(3, run(), 0);
  t.update(run({ requested_size: 3 }), 100);
  assert.equal(t.update(run({ requested_size: 2 }), 200).kind, 'superseded');
});

test('before the acknowledgement the old requested_size is no verdict; a third size is', () => {
  const t = new ResizeTracker();
  t.request(3, run(), 0);
  assert.equal(t.update(run(), 100).kind, 'pending'); // not there yet (sent later, coalesced)
  assert.equal(t.update(run({ requested_size: 4 }), 200).kind, 'superseded'); // someone else's, newer
});

test('a refused request fails with the server\'s message; a run that ends fails the request', () => {
  const t = new ResizeTracker();
  t.request(9, run(), 0);
  t.fail('pool size 9 is outside this pool\'s bounds [1, 4]');
  assert.equal(t.pending, null);
  const fb = t.update(run({ requested_size: 3 }), 100); // a failure is not hidden by other news
  assert.equal(fb.kind, 'failed');
  assert.match(fb.text, /bounds \[1, 4\]/);
  t.request(3, run(), 0);
  assert.equal(t.update(run({ requested_size: 3 }), 100).kind, 'pending');
  const ended = t.update(run({ state: 'stopped', requested_size: 3 }), 200);
  assert.equal(ended.kind, 'failed');
  assert.match(ended.text, /the run is stopped/);
});

test('resizes this view did not ask for show as pending; old news is dropped', () => {
  const t = new ResizeTracker();
  assert.equal(t.update(run({ requested_size: 3 }), 0).kind, 'pending');
  assert.match(t.update(run({ world_size: 3, requested_size: 3, resize: life(2, 3, 1) }), 0).text, /2 → 3: pending/);
  assert.equal(t.update(run(), 0).kind, 'none');
  assert.equal(t.update(run({ state: 'finished', requested_size: 3 }), 0).kind, 'none'); // not when ended
  t.request(3, run(), 0);
  assert.equal(t.update(run({ world_size: 3, requested_size: 3 }), 1000).kind, 'done');
  assert.equal(t.update(run({ world_size: 3, requested_size: 1 }), 2000).kind, 'pending'); // a newer one elsewhere
  assert.equal(t.update(run({ world_size: 1, requested_size: 1 }), 3000).kind, 'none'); // done with 3 is old news
});
