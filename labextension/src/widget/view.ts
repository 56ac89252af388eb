/**
 * The notebook dashboard's DOM and the texts it shows for a run snapshot; dashboard.ts wires
 * them to the widget model.
 */
import { h } from '../common/dom';
import { Feedback } from '../common/resize';
import { RunSnapshot, describeExcluded, describeQueued } from '../common/snapshot';

export function buildDom(el: HTMLElement) {
  const title = h('span', { class: 'ej-title' });
  const state = h('span', { class: 'ej-state' });
  const line = h('span', { class: 'ej-line' });
  const slider = h('input', { class: 'ej-slider', type: 'range', step: '1', 'aria-label': 'pool size' });
  const sliderValue = h('span', { class: 'ej-slider-value' });
  const size = h('span', { class: 'ej-size' });
  const stop = h('button', { class: 'ej-button' }, 'Stop');
  const auto = h('input', { class: 'ej-auto', type: 'checkbox', 'aria-label': 'auto mode' });
  const autoLabel = h('label', { class: 'ej-auto-label', title: "Auto mode: the machine's arbiter grows the run into free slots and takes slots back for other runs' fair share" }, auto, ' Auto');
  const logsButton = h('button', { class: 'ej-button' }, 'Logs');
  const smoothing = h('input', { class: 'ej-smoothing', type: 'range', min: '0', max: '0.99', step: '0.01', value: '0.6' });
  const log = h('input', { type: 'checkbox' });
  const metric = h('select', { class: 'ej-metric' });
  const chart = h('div', { class: 'ej-chart-box' });
  const reason = h('div', { class: 'ej-reason' });
  const notice = h('div', { class: 'ej-notice' });
  const logs = h('pre', { class: 'ej-logs', hidden: true });
  const root = h('div', { class: 'ej-dashboard' },
    h('div', { class: 'ej-row' }, title, state, line),
    h('div', { class: 'ej-row' }, h('span', { class: 'ej-label' }, 'Pool size'), slider, sliderValue, size, autoLabel, stop, logsButton),
    reason,
    notice,
    h('div', { class: 'ej-row ej-options' },
      h('span', { class: 'ej-label' }, 'Smoothing'), smoothing, h('label', {}, log, ' log scale'),
      h('span', { class: 'ej-label' }, 'Metric'), metric, legend()),
    chart,
    logs);
  el.append(root);
  return { root, title, state, line, slider, sliderValue, size, stop, auto, autoLabel, logsButton, smoothing, log, metric, chart, reason, notice, logs };
}

function legend(): HTMLElement {
  const marks = [['resized', 'resize'], ['fault', 'fault'], ['checkpoint', 'checkpoint']];
  return h('span', { class: 'ej-legend' }, ...marks.map(([kind, text]) => h('span', { class: `ej-mark ej-mark-${kind}` }, text)));
}

/** The pool-size line: the resize this view asked for, else the run's latest resize. */
export function sizeText(s: RunSnapshot, feedback: Feedback): string {
  const took = (from: number, to: number, latency: number) => ` (resize ${from} → ${to} took ${latency.toFixed(2)} s)`;
  switch (feedback.kind) {
    case 'done':
      return `world size ${s.world_size}` + took(feedback.from!, feedback.to!, feedback.latency_s!);
    case 'failed':
      return `world size ${s.world_size} · ${feedback.text}`;
    case 'none': {
      const r = s.resize;
      return `world size ${s.world_size}` + (r && !r.pending && r.latency_s !== null ? took(r.from, r.to, r.latency_s) : '');
    }
    default:
      return feedback.text;
  }
}

export function statusLine(s: RunSnapshot): string {
  const parts = [`step ${s.step}/${s.total_steps || '?'}`];
  if (s.epoch !== null) {
    parts.push(`epoch ${s.epoch}`);
  }
  if (s.samples_per_s !== null) {
    parts.push(`${Math.round(s.samples_per_s)} samples/s`);
  }
  if (s.eta_s !== null) {
    parts.push(`ETA ${formatSeconds(s.eta_s)}`);
  }
  parts.push(s.last_checkpoint ? `checkpoint ${s.last_checkpoint}` : 'no checkpoint yet');
  for (const extra of [describeQueued(s), describeExcluded(s, Date.now())]) {
    if (extra) {
      parts.push(extra);
    }
  }
  return parts.join(' · ');
}

/** Why the controls are off, for a run that no longer trains. */
export function reason(s: RunSnapshot): string {
  if (s.state === 'failed') {
    return `Training failed: ${s.error ?? 'see the logs'}. Resizing is off.`;
  }
  if (s.state === 'finished' || s.state === 'stopped') {
    return `The run has ${s.state}: resizing is off. Continue it with %%elastic_train --resume.`;
  }
  return '';
}

function formatSeconds(t: number): string {
  const s = Math.round(t);
  return s >= 3600 ? `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min` : s >= 60 ? `${Math.floor(s / 60)} min ${s % 60} s` : `${s} s`;
}
