/**
 * The side panel's DOM: a run's row in the list, the selected run's detail box and its
 * checkpoint links. Built once per row or selection; panel.ts updates the detail in place.
 */
import { h, svg } from '../common/dom';
import { MachineView, RunSnapshot, isActive } from '../common/snapshot';
import { describeSlots, sparklinePoints } from './model';

export interface RowActions {
  select(): void;
  dismiss: (() => void) | null; // only for an ended run
}

export function renderRow(run: RunSnapshot, selected: boolean, actions: RowActions): HTMLElement {
  const sizes = isActive(run) ? `W ${run.world_size}/${run.requested_size || run.world_size}` : '';
  const loss = run.loss === null ? '' : `loss ${run.loss.toFixed(4)}`;
  const steps = `step ${run.step}${run.total_steps ? '/' + run.total_steps : ''}`;
  const dismiss = actions.dismiss && h('button', {
    class: 'ejp-dismiss', title: 'Dismiss: remove this ended run from the list (its checkpoints stay on disk)',
    'aria-label': `dismiss ${run.name}`,
    onclick: (event: MouseEvent) => {
      event.stopPropagation(); // not a click on the row: no selection
      actions.dismiss!();
    }
  }, '×');
  const row = h('li', { class: `ejp-run${selected ? ' ejp-selected' : ''}`, 'data-run-id': run.id, 'data-state': run.state, title: run.notebook ?? '', onclick: actions.select },
    h('div', { class: 'ejp-row' }, h('span', { class: 'ejp-name' }, run.name), h('span', { class: 'ejp-row-end' }, h('span', { class: 'ejp-state' }, run.state), dismiss)),
    h('div', { class: 'ejp-row ejp-dim' },
      h('span', {}, [sizes, steps, loss].filter(Boolean).join(' · ')),
      svg('svg', { class: 'ejp-spark', viewBox: '0 0 80 20' }, svg('polyline', { points: sparklinePoints(run.recent_loss, 80, 20) }))),
    h('div', { class: 'ejp-dim ejp-where' }, [basename(run.notebook), isActive(run) ? describeSlots(run.slots) : ''].filter(Boolean).join(' · ')));
  return row;
}

export function buildDetail() {
  const title = h('h3', { class: 'ejp-title' });
  const slider = h('input', { class: 'ejp-slider', type: 'range', step: '1', 'aria-label': 'pool size' });
  const value = h('span', { class: 'ejp-value' });
  const stop = h('button', { class: 'jp-Button jp-mod-styled jp-mod-warn ejp-stop' }, 'Stop');
  const auto = h('input', { class: 'ejp-auto', type: 'checkbox', 'aria-label': 'auto mode' });
  const autoLabel = h('label', { class: 'ejp-auto-label', title: "Auto mode: the machine's arbiter grows the run into free slots and takes slots back for other runs' fair share" }, auto, ' Auto');
  const leaseInfo = h('div', { class: 'ejp-dim ejp-lease' });
  const controls = h('div', { class: 'ejp-controls' }, h('span', { class: 'ejp-dim' }, 'Pool size'), slider, value, autoLabel, stop);
  const feedback = h('div', { class: 'ejp-feedback' });
  const reason = h('div', { class: 'ejp-reason' });
  const chart = h('div', { class: 'ejp-chart' });
  const checkpoints = h('ul', { class: 'ejp-checkpoints' });
  const logsButton = h('button', { class: 'jp-Button jp-mod-styled ejp-logs-button' }, 'Logs');
  const logs = h('pre', { class: 'ejp-logs', hidden: true });
  const root = h('div', { class: 'ejp-detail-box' },
    title, controls, leaseInfo, feedback, reason, chart, h('div', { class: 'ejp-dim' }, 'Checkpoints'), checkpoints, logsButton, logs);
  return { root, title, slider, value, stop, auto, autoLabel, leaseInfo, controls, feedback, reason, chart, checkpoints, logsButton, logs };
}

/** Newest first; those under the server root open in the file browser (`open`). */
export function renderCheckpoints(run: RunSnapshot, open: (browserPath: string) => void): HTMLElement[] {
  return run.checkpoints.slice().reverse().map(c => {
    const label = `step ${c.step} · ${new Date(c.time * 1000).toLocaleTimeString()} · ${(c.bytes / 1e6).toFixed(2)} MB`;
    const link = c.browser_path && h('a', {
      class: 'ejp-link', href: '#', title: c.path,
      onclick: (event: MouseEvent) => {
        event.preventDefault();
        open(c.browser_path!);
      }
    }, label);
    return h('li', {}, link || `${label} · ${c.path}`);
  });
}

/** The machine's slots (holder, for how long, use) and runs, as its arbiter sees them. */
export function renderMachine(view: MachineView, now: number): HTMLElement[] {
  if (!view.available) {
    return [h('div', { class: 'ejp-dim' }, view.message ?? 'No slot arbiter on this machine.')];
  }
  const kind = view.kind === 'gpu' ? 'GPU' : 'slot';
  const slots = (view.slots ?? []).map(s => {
    const holder = s.holder
      ? `${s.holder.name}${s.holder.standby ? ' (standby)' : ''} · ${s.holder.user}${s.holder.notebook ? ' · ' + basename(s.holder.notebook) : ''} · ${formatAge(now - s.holder.since)}${s.holder.lent_by ? ` · lent by ${s.holder.lent_by.user}/${s.holder.lent_by.name}` : ''}`
      : s.outside ? `outside: ${s.outside}` : 'free';
    const use = [s.util !== undefined ? `${s.util}%` : '', s.memory_mib !== undefined ? `${s.memory_mib} MiB` : ''].filter(Boolean).join(' · ');
    return h('tr', { class: 'ejp-slot', 'data-slot': String(s.slot), 'data-holder': s.holder?.name ?? (s.outside ? 'outside' : 'free'), 'data-lent-by': s.holder?.lent_by?.name ?? '' },
      h('td', {}, `${kind} ${s.slot}`), h('td', {}, holder), h('td', { class: 'ejp-dim' }, use));
  });
  const runs = (view.runs ?? []).map(r => h('tr', { class: 'ejp-machine-run', 'data-run': r.name, 'data-auto': String(r.auto) },
    h('td', {}, r.name), h('td', { class: 'ejp-dim' }, r.user),
    h('td', {}, `${r.held}/${r.target} [${r.min}–${r.max}]${r.auto ? ` auto ×${r.weight}` : ''}`),
    h('td', { class: 'ejp-dim' }, r.queued ? `queued #${r.queued}` : '')));
  return [h('table', { class: 'ejp-machine-slots' }, ...slots), h('table', { class: 'ejp-machine-runs' }, ...runs)];
}

function formatAge(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  return s < 120 ? `${s} s` : s < 7200 ? `${Math.round(s / 60)} min` : `${Math.round(s / 3600)} h`;
}

function basename(path: string | null): string {
  return path ? path.split('/').pop() ?? path : '';
}
