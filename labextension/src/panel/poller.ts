/**
 * The side panel's poll: Lumino's Poll (standby while the browser tab is hidden, exponential
 * back-off after errors), with one addition: while nothing changes the interval grows by half
 * up to `max`, and snaps back to the base interval on a change. A tick never overlaps the one
 * in flight: a refresh asked for meanwhile runs once right after it (two overlapping history
 * pages would add the same events twice).
 */
import { Poll } from '@lumino/polling';

export const MAX_INTERVAL_MS = 10_000;

/** The next interval after a tick that `changed` anything or not. */
export function nextInterval(current: number, base: number, max: number, changed: boolean): number {
  return changed ? base : Math.min(Math.max(max, base), Math.round(current * 1.5));
}

export class ChangePoll {
  private base: number;
  private running: Promise<boolean> | null = null;
  private queued: Promise<boolean> | null = null;
  readonly poll: Poll;

  /** `tick` polls once and says whether anything changed. */
  constructor(private tick: () => Promise<boolean>, base: number, private max = MAX_INTERVAL_MS) {
    this.base = base;
    this.poll = new Poll({
      auto: false,
      name: 'elastic-jupyter:runs',
      factory: () => this.once(),
      frequency: this.frequency(base),
      standby: 'when-hidden'
    });
  }

  /** The base interval (the panel's setting). */
  set interval(ms: number) {
    this.base = ms;
    this.poll.frequency = this.frequency(ms);
  }

  get interval(): number {
    return this.poll.frequency.interval;
  }

  start(): void {
    void this.poll.start();
  }

  stop(): void {
    void this.poll.stop();
  }

  /** Poll now, at the base interval again. */
  refresh(): void {
    this.poll.frequency = this.frequency(this.base);
    void this.poll.refresh();
  }

  dispose(): void {
    void this.poll.stop(); // clears the timer, which Poll.dispose leaves to run out
    this.poll.dispose();
  }

  private async once(): Promise<void> {
    const changed = await this.serial();
    // read by the Poll when it schedules the tick after this one resolves
    this.poll.frequency = this.frequency(nextInterval(this.poll.frequency.interval, this.base, this.max, changed));
  }

  private serial(): Promise<boolean> {
    if (!this.running) {
      this.running = this.tick().finally(() => (this.running = null));
      return this.running;
    }
    this.queued ??= this.running.catch(() => false).then(() => {
      this.queued = null;
      return this.serial();
    });
    return this.queued;
  }

  private frequency(interval: number) {
    return { interval, backoff: true, max: Math.max(this.max, interval) };
  }
}
