/**
 * The side panel's poll: Lumino's Poll with an interval that grows while nothing changes and
 * snaps back on a change, and ticks that never overlap.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { ChangePoll, nextInterval } from '../src/panel/poller';

test('the interval grows by half while nothing changes, up to the max, and snaps back', () => {
  assert.equal(nextInterval(1000, 1000, 10_000, false), 1500);
  assert.equal(nextInterval(1500, 1000, 10_000, false), 2250);
  assert.equal(nextInterval(9000, 1000, 10_000, false), 10_000);
  assert.equal(nextInterval(10_000, 1000, 10_000, true), 1000);
  assert.equal(nextInterval(60_000, 60_000, 10_000, false), 60_000); // a setting above the max is kept
});

/** Resolves once `condition()` holds (checked every few ms). */
async function until(condition: () => boolean): Promise<void> {
  while (!condition()) {
    await new Promise(resolve => setTimeout(resolve, 2));
  }
}

test('a poll backs off while nothing changes and snaps back on a change', async t => {
  let changed = false;
  const intervals: number[] = []; // the interval that led to each tick
  const poll: ChangePoll = new ChangePoll(async () => {
    intervals.push(poll.interval);
    return changed;
  }, 10, 40);
  t.after(() => poll.dispose());
  poll.start();
  await until(() => intervals.length >= 6);
  changed = true;
  const n = intervals.length;
  await until(() => intervals.length >= n + 2);
  poll.stop();
  assert.deepEqual(intervals.slice(0, 6), [10, 15, 23, 35, 40, 40]);
  assert.equal(intervals[n + 1], 10);
  const stopped = intervals.length;
  await new Promise(resolve => setTimeout(resolve, 60));
  assert.equal(intervals.length, stopped); // stopped: no more ticks
});

test('a refresh during a tick in flight runs once after it, never alongside', async t => {
  let inFlight = 0;
  let most = 0;
  let ticks = 0;
  let release: () => void = () => undefined;
  const poll = new ChangePoll(async () => {
    ticks++;
    most = Math.max(most, ++inFlight);
    await new Promise<void>(resolve => (release = resolve));
    inFlight--;
    return true;
  }, 10_000);
  t.after(() => poll.dispose());
  poll.start();
  await until(() => ticks === 1);
  poll.refresh();
  poll.refresh();
  await new Promise(resolve => setTimeout(resolve, 10));
  assert.equal(ticks, 1);
  release();
  await until(() => ticks === 2); // the queued one, once
  release();
  await new Promise(resolve => setTimeout(resolve, 10));
  assert.equal(ticks, 2);
  assert.equal(most, 1);
  assert.equal(poll.interval, 10_000); // refreshed at the base interval
});
