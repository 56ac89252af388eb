/**
 * The side panel's logic without any DOM: what a run row shows, what counts as a change worth
 * a faster poll, and the history cursor.
 */
import { History } from '../chart/history';
import { HistoryPage } from '../common/api';
import { LeaseState, RunSnapshot, isActive } from '../common/snapshot';

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

/** "auto ×1 · slots 0, 2 · up to 3 now · queued #1": the pool's lease in one line. */
export function describeLease(lease: LeaseState | null): string {
  if (!lease) {
    return '';
  }
  return [
    lease.auto ? `auto ×${lease.weight}` : 'manual',
    `slots ${lease.slots.join(', ') || 'none'}`,
    lease.standby.length ? `standby ${lease.standby.join(', ')}` : '',
    `up to ${lease.grantable} now`,
    lease.queued ? `queued #${lease.queued}` : '',
    ...(lease.lent ?? []).map(l => `slot ${l.slot} lent to ${l.user}/${l.to}; back when you train`)
  ].filter(Boolean).join(' · ');
}

/** The fields whose change is worth a faster poll and a redraw. */
export function fingerprint(runs: RunSnapshot[]): string {
  return JSON.stringify(runs.map(r => [
    r.id, r.state, r.step, r.world_size, r.requested_size, r.resize?.pending, r.checkpoints.length,
    r.lease?.auto, r.lease?.slots, r.lease?.lent, r.queued, r.excluded
  ]));
}

/**
 * The runs as the panel knows them. A poll's answer may have left the server before a write
 * (resize, stop, dismiss) that answered meanwhile; it is dropped, so a dismissed run does not
 * come back and a resize's slider does not jump back (the write's refresh brings news).
 */
export class RunList {
  runs: RunSnapshot[] = [];
  private writes = 0;
  private print = '';

  /** Call when a poll starts; give the token back with its answer. */
  begin(): number {
    return this.writes;
  }

  /**
   * The poll's answer; whether the next poll should come at the base interval: something
   * changed, or a run is active (one being stopped shows no new step until it has stopped,
   * and the panel must not back off meanwhile). Only a quiet list of ended runs backs off.
   */
  apply(runs: RunSnapshot[], token: number): boolean {
    if (token !== this.writes) {
      return true; // stale: poll again soon
    }
    this.runs = runs;
    const print = fingerprint(runs);
    const changed = print !== this.print;
    this.print = print;
    return changed || runs.some(isActive);
  }

  /** A write's answer: the run as the server has it now. */
  upsert(model: RunSnapshot): void {
    this.writes++;
    this.runs = this.runs.map(r => (r.id === model.id ? model : r));
  }

  remove(id: string): void {
    this.writes++;
    this.runs = this.runs.filter(r => r.id !== id);
  }

  find(id: string | null): RunSnapshot | undefined {
    return this.runs.find(r => r.id === id);
  }
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
export function sparklinePoints(values: (number | null)[], width: number, height: number): string {
  const finite = values.filter((v): v is number => Number.isFinite(v));
  if (finite.length < 2) {
    return '';
  }
  const lo = Math.min(...finite);
  const span = Math.max(...finite) - lo || 1;
  const dx = width / (values.length - 1);
  return values
    .map((v, i) => (v !== null && Number.isFinite(v) ? `${(i * dx).toFixed(1)},${(height - 1 - ((v - lo) / span) * (height - 2)).toFixed(1)}` : ''))
    .filter(Boolean)
    .join(' ');
}
