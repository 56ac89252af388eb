/**
 * Pending -> done feedback of the resize requests one view makes for one run; the side panel
 * and the notebook dashboard use the same tracker, so "done" means the same in both: the run
 * completed its first training step at the new size.
 */
import { RunSnapshot, isActive } from './snapshot';

export type FeedbackKind = 'none' | 'pending' | 'done' | 'already' | 'superseded' | 'failed';

export interface Feedback {
  kind: FeedbackKind;
  text: string;
  to?: number; // with 'done' and 'already': the size
  from?: number; // with 'done': the resize carried out and how long it took
  latency_s?: number;
}

/**
 * A slider's debounce (ms): while it moves, only its last value is sent. A UI debounce, not the
 * coalescing of requests, which the run's sizer does for every front end (sizing.COALESCE_S).
 */
export const SLIDER_DEBOUNCE_MS = 150;

type Sizes = Pick<RunSnapshot, 'state' | 'world_size' | 'requested_size' | 'resize'>;

/** The run trains at `size` with nothing left to carry out. */
export function settledAt(run: Sizes, size: number): boolean {
  return run.world_size === size && run.requested_size === size && !run.resize?.pending;
}

export class ResizeTracker {
  private target: number | null = null;
  private since = 0; // ms, when this view asked
  private from = 0;
  private before = 0; // the run's requested_size when this view asked
  private prior: number | null = null; // requested_time of the resize the run described then
  private acknowledged = false;
  private last: Feedback = { kind: 'none', text: '' };

  /** The size this view asked for and waits for, if any. */
  get pending(): number | null {
    return this.target;
  }

  /**
   * A request from this view, given the run as the view sees it (times in ms). False when
   * there is nothing to send: the run already trains at that size.
   */
  request(size: number, run: Sizes, now: number): boolean {
    if (settledAt(run, size)) {
      this.target = null;
      this.last = { kind: 'already', text: `already ${size}`, to: size };
      return false;
    }
    this.target = size;
    this.since = now;
    this.from = run.world_size;
    this.before = run.requested_size;
    this.prior = run.resize?.requested_time ?? null;
    this.acknowledged = false;
    this.last = { kind: 'pending', text: `world size ${run.world_size} → ${size}: sending…` };
    return true;
  }

  /** The request was refused; `message` is the server's reason. */
  fail(message: string): void {
    this.target = null;
    this.last = { kind: 'failed', text: message };
  }

  /** Feedback given the newest snapshot of the run. */
  update(run: Sizes, now: number): Feedback {
    const target = this.target;
    if (target === null) {
      const other = this.last.kind !== 'failed' && isActive(run) ? elsewhere(run) : null;
      if (other) {
        return other;
      }
      if ((this.last.kind === 'done' || this.last.kind === 'already') && run.world_size !== this.last.to) {
        this.last = { kind: 'none', text: '' }; // the run has resized again since: old news
      }
      return this.last;
    }
    if (settledAt(run, target)) {
      this.last = this.done(run, target, now);
      this.target = null;
    } else if (!isActive(run)) {
      this.last = { kind: 'failed', text: `not resized: the run is ${run.state}` };
      this.target = null;
    } else if (run.requested_size === target) {
      this.acknowledged = true; // the run has this request
      this.last = { kind: 'pending', text: `world size ${run.world_size} → ${target}: pending… (${seconds(now - this.since)} s)` };
    } else if (this.acknowledged || run.requested_size !== this.before) {
      // a request made after this one (another tab, a scheduled resize): the newest wins
      this.last = { kind: 'superseded', text: `another request asked for ${run.requested_size}; it wins` };
      this.target = null;
    } else {
      this.last = { kind: 'pending', text: `world size ${run.world_size} → ${target}: sending… (${seconds(now - this.since)} s)` };
    }
    return this.last;
  }

  private done(run: Sizes, target: number, now: number): Feedback {
    const r = run.resize;
    // the run's own measure (request to first step at the new size) when it describes this
    // resize; else (an older server, or no generation was needed) the time seen here
    const own = r && r.to === target && r.requested_time !== this.prior && r.latency_s !== null;
    const latency = own ? r.latency_s! : (now - this.since) / 1000;
    return {
      kind: 'done', text: `world size ${target}: done in ${latency.toFixed(1)} s`,
      from: own ? r.from : this.from, to: target, latency_s: latency
    };
  }
}

/** A resize this view did not ask for, still under way. */
function elsewhere(run: Sizes): Feedback | null {
  if (run.requested_size > 0 && run.requested_size !== run.world_size) {
    return { kind: 'pending', text: `world size ${run.world_size} → ${run.requested_size}: pending…` };
  }
  if (run.resize?.pending) {
    return { kind: 'pending', text: `world size ${run.resize.from} → ${run.resize.to}: pending…` };
  }
  return null;
}

function seconds(ms: number): string {
  return (ms / 1000).toFixed(1);
}
