/** A training run's snapshot for the tests, with `fields` changed. */
import { RunSnapshot, toSnapshot } from '../src/common/snapshot';

export function run(fields: Partial<RunSnapshot> = {}): RunSnapshot {
  return toSnapshot({
    id: 'r-1', name: 'digits', notebook: 'q.ipynb', state: 'training', step: 10, total_steps: 100,
    world_size: 2, requested_size: 2, min_size: 1, max_size: 4, loss: 1, ...fields
  });
}

/** The `resize` life of a run after a resize `from` -> `to` requested at `requested_time` (s). */
export function life(from: number, to: number, requested_time: number, latency_s: number | null = null) {
  return { from, to, step: 10, requested_time, pending: latency_s === null, latency_s };
}
