/**
 * The side panel's logic without any DOM: run models as the server extension sends them, the
 * pending -> done feedback of a resize, poll back-off and the history cursor.
 */
import { History } from '../chart/history';

export interface Checkpoint {
  file: string;
  path: string;
  step: number;
  bytes: number;
  time: number;
  browser_path: string | null; // relative to the server root, null when outside it
}

export interface RunModel {
  id: string;
  name: string;
  notebook: string | null;
  state: string; // starting | training | resizing | finished | failed | stopped | lost
  step: number;
  total_steps: number | null;
  world_size: number;
  requested_size: number;
  min_size?: number;
  max_size?: number;
  loss: number | null;
  recent_loss: number[];
  slots: string[];
  checkpoints: Checkpoint[];
  error: string | null;
}

export const ACTIVE_STATES = ['starting', 'training', 'resizing'];

export function isActive(run: RunModel): boolean {
  return ACTIVE_STATES.includes(run.state);
}

/** "2 CPU slots", "GPU 0, 1": what the run occupies. */
export function describeSlots(slots: string[]): string {
  const gpus = slots.filter(s => s.startsWith('cuda:')).map(s => s.slice(5));
  const cpus = slots.length - gpus.length;
  const parts = [];
  if (gpus.length) {
    parts.push(`GPU ${gpus.join(', ')}`);
  }
  if (cpus) {
    parts.push(`${cpus} CPU slot${cpus > 1 ? 's' : ''}`);
  }
  return parts.join(' + ') || 'no slots';
}

export interface Feedback {
  kind: 'none' | 'pending' | 'done' | 'superseded' | 'failed';
  text: string;
}

/**
 * Pending -> done feedback for one run's resize requests made from this view. The server's
 * model is the truth: when another tab asked for another size later, this view says so
 * (the last request wins).
 */
export class ResizeTracker {
  private target: number | null = null;
  private since = 0;
  private last: Feedback = { kind: 'none', text: '' };

  request(size: number, now: number): void {
    this.target = size;
    this.since = now;
    this.last = { kind: 'pending', text: `resize to ${size}: sending…` };
  }

  fail(message: string): void {
    this.target = null;
    this.last = { kind: 'failed', text: message };
  }

  /** Feedback given the newest model of the run (times in ms). */
  update(run: RunModel, now: number): Feedback {
    if (this.target === null) {
      if (this.last.kind !== 'failed' && run.requested_size && run.requested_size !== run.world_size && isActive(run)) {
        return { kind: 'pending', text: `world size ${run.world_size} → ${run.requested_size}: pending…` };
      }
      return this.last;
    }
    const seconds = ((now - this.since) / 1000).toFixed(1);
    if (run.world_size === this.target) {
      this.last = { kind: 'done', text: `world size ${run.world_size}: done in ${seconds} s` };
      this.target = null;
    } else if (!isActive(run)) {
      this.last = { kind: 'failed', text: `not resized: the run is ${run.state}` };
      this.target = null;
    } else if (run.requested_size !== this.target && now - this.since > 2000) {
      this.last = { kind: 'superseded', text: `another request asked for ${run.requested_size}; it wins` };
      this.target = null;
    } else {
      this.last = { kind: 'pending', text: `world size ${run.world_size} → ${this.target}: pending… (${seconds} s)` };
    }
    return this.last;
  }
}

/**
 * Poll delays: `base` while something changes, growing by half up to `max` while nothing
 * does, doubling after an error. The panel stops polling while it is hidden.
 */
export class Backoff {
  private delay: number;

  constructor(public base: number, public max: number) {
    this.delay = base;
  }

  next(changed: boolean, failed: boolean): number {
    const max = Math.max(this.max, this.base); // a poll interval set above max is kept
    if (failed) {
      this.delay = Math.min(max, this.delay * 2);
    } else if (changed) {
      this.delay = this.base;
    } else {
      this.delay = Math.min(max, Math.round(this.delay * 1.5));
    }
    return this.delay;
  }

  reset(): void {
    this.delay = this.base;
  }
}

/** The fields whose change is worth a faster poll and a redraw. */
export function fingerprint(runs: RunModel[]): string {
  return JSON.stringify(runs.map(r => [r.id, r.state, r.step, r.world_size, r.requested_size, r.checkpoints.length]));
}

export interface HistoryPage {
  columns: string[];
  data: (number | null)[][];
  events: { kind: string; step: number; [key: string]: unknown }[];
  next: { since: number; events_since: number };
}

/**
 * A run's history fetched page by page with a cursor (`?since=step&events_since=n`), so a poll
 * never resends what this view has. A fault that rolled the run back truncates it first.
 */
export class HistoryCursor {
  readonly history = new History();
  readonly events: HistoryPage['events'] = [];
  since = 0;
  eventsSince = 0;

  apply(page: HistoryPage): boolean {
    this.events.push(...page.events);
    this.eventsSince = page.next.events_since;
    const rollbacks = page.events
      .filter(e => e.kind === 'fault' && typeof e.rolled_back_to === 'number')
      .map(e => e.rolled_back_to as number);
    if (rollbacks.length) {
      // steps after the rollback were run again: drop them and fetch them anew next time
      this.history.truncate(Math.min(...rollbacks));
      this.since = this.history.lastStep;
      return true;
    }
    const added = page.columns.length ? this.history.appendColumns(page.columns, page.data) : 0;
    this.since = Math.max(page.next.since, this.history.lastStep);
    return added > 0 || page.events.length > 0;
  }
}

/** SVG polyline points for a sparkline of `values` in a width x height box. */
export function sparklinePoints(values: number[], width: number, height: number): string {
  const finite = values.filter(Number.isFinite);
  if (finite.length < 2) {
    return '';
  }
  const lo = Math.min(...finite);
  const span = Math.max(...finite) - lo || 1;
  const dx = width / (values.length - 1);
  return values
    .map((v, i) => (Number.isFinite(v) ? `${(i * dx).toFixed(1)},${(height - 1 - ((v - lo) / span) * (height - 2)).toFixed(1)}` : ''))
    .filter(Boolean)
    .join(' ');
}
