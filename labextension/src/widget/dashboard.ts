/**
 * The notebook dashboard (anywidget front end of elastic_jupyter/dashboard.py): pool-size slider
 * with pending -> done feedback, stop button, live loss chart and status line.
 *
 * A view starts from the `history` trait (a decimated copy of the whole run), asks the kernel
 * for the rows after it ("hello"), then applies binary "append" / "truncate" messages. Zooming
 * into a decimated span asks for full-resolution rows ("range").
 */
import type { AnyModel, RenderProps } from '@anywidget/types';

import { History } from '../chart/history';
import { LossChart, Marker } from '../chart/lossChart';
import { requestRun } from './serverPath';
import './dashboard.css';

interface Status {
  state: string;
  step: number;
  total_steps: number;
  epoch: number | null;
  world_size: number;
  requested_size: number;
  samples_per_s: number | null;
  eta_s: number | null;
  error: string | null;
  log_dir: string;
  last_checkpoint: string | null;
  last_resize: { from: number; to: number; latency_s: number; step: number } | null;
}

interface Model {
  name: string;
  run_id: string | null;
  min_size: number;
  max_size: number;
  status: Status;
  events: Marker[];
  history: { columns?: string[]; data?: (number | null)[][]; decimated?: boolean };
  notice: string;
}

const DISCONNECTED_AFTER_MS = 4000; // the kernel sends a beat every second
const ACTIVE = ['starting', 'training', 'resizing'];
const COALESCE_MS = 150;

function render({ model, el }: RenderProps<Model>): () => void {
  const view = new DashboardView(model, el);
  return () => view.dispose();
}

class DashboardView {
  private history = new History();
  private chart: LossChart;
  private ui: ReturnType<typeof buildDom>;
  private requested: number | null = null; // the slider's last request, until the kernel has it
  private lastBeat = Date.now();
  private beatTimer: number;
  private frame = 0;
  private resizeTimer = 0;
  private helloPending = false; // asked the kernel for the rows this view lacks
  private ended = false; // the kernel's feeder stopped: no beats to expect
  private restarted = false; // the kernel behind this view is gone for good
  private unwatchKernel: () => void;

  constructor(private model: AnyModel<Model>, el: HTMLElement) {
    this.ui = buildDom(el);
    this.ui.title.textContent = `Run ${model.get('name')}`;
    this.chart = new LossChart(this.ui.chart, { smoothing: 0.6, log: false, metric: null }, range => this.zoomed(range));
    this.loadSnapshot();
    model.on('msg:custom', (msg, buffers) => this.onMessage(msg, buffers));
    model.on('change:status', () => this.showStatus());
    model.on('change:events', () => this.chart.setMarkers(model.get('events')));
    model.on('change:notice', () => this.showNotice());
    this.wireControls();
    this.showStatus();
    this.showNotice();
    this.chart.setMarkers(model.get('events'));
    this.askForRest();
    this.beatTimer = window.setInterval(() => this.checkConnection(), 1000);
    this.unwatchKernel = this.watchKernel();
  }

  dispose(): void {
    this.unwatchKernel();
    window.clearInterval(this.beatTimer);
    window.clearTimeout(this.resizeTimer);
    cancelAnimationFrame(this.frame);
    this.chart.destroy();
  }

  private askForRest(): void {
    if (!this.helloPending) {
      this.helloPending = true;
      this.model.send({ type: 'hello', after: this.history.lastStep });
    }
  }

  private loadSnapshot(): void {
    const snapshot = this.model.get('history');
    if (snapshot.columns && snapshot.data) {
      this.history.load(snapshot.columns, snapshot.data);
    }
    this.refreshMetrics();
    this.redraw();
  }

  private onMessage(msg: { type: string; [key: string]: any }, buffers: DataView[]): void {
    this.lastBeat = Date.now();
    if (this.ui.root.classList.contains('ej-disconnected') && !this.restarted) {
      this.ui.root.classList.remove('ej-disconnected');
      this.showStatus(); // the kernel answers again (it was only busy)
    }
    if (msg.type === 'append') {
      if (msg.reply) {
        this.helloPending = false;
      }
      if (this.history.appendBinary(msg.columns, buffers, msg.after) < 0) {
        this.askForRest(); // rows between what this view holds and `after` are missing
        return;
      }
    } else if (msg.type === 'ended') {
      this.ended = true;
      return;
    } else if (msg.type === 'truncate') {
      this.history.truncate(msg.after);
    } else if (msg.type === 'range') {
      this.history.spliceRange(msg.from, msg.to, msg.columns, buffers);
    } else if (msg.type === 'logs') {
      this.ui.logs.textContent = msg.text;
      this.ui.logs.hidden = false;
      return;
    } else {
      return; // 'beat'
    }
    this.refreshMetrics();
    this.redraw();
  }

  /** Coalesce redraws to one per animation frame. */
  private redraw(): void {
    if (!this.frame) {
      this.frame = requestAnimationFrame(() => {
        this.frame = 0;
        this.chart.setHistory(this.history);
      });
    }
  }

  private zoomed(range: [number, number] | null): void {
    if (range && this.history.rowsIn(range[0], range[1]) < range[1] - range[0] + 1) {
      this.model.send({ type: 'range', from: range[0], to: range[1] }); // decimated: fetch detail
    }
  }

  private wireControls(): void {
    const { slider, stop, logsButton, smoothing, log, metric } = this.ui;
    slider.addEventListener('input', () => this.showSize(Number(slider.value)));
    slider.addEventListener('change', () => {
      this.requested = Number(slider.value);
      this.showStatus();
      window.clearTimeout(this.resizeTimer); // quick moves (keyboard): only the last is sent
      this.resizeTimer = window.setTimeout(() => void this.request('resize', this.requested!), COALESCE_MS);
    });
    stop.addEventListener('click', () => {
      if (window.confirm(`Stop run '${this.model.get('name')}'? A checkpoint is written first.`)) {
        void this.request('stop');
      }
    });
    logsButton.addEventListener('click', () => {
      if (this.ui.logs.hidden) {
        this.model.send({ type: 'logs' });
      } else {
        this.ui.logs.hidden = true;
      }
    });
    smoothing.addEventListener('input', () => this.chart.setOptions({ smoothing: Number(smoothing.value) }));
    log.addEventListener('change', () => this.chart.setOptions({ log: log.checked }));
    metric.addEventListener('change', () => this.chart.setOptions({ metric: metric.value || null }));
  }

  /** Over the server extension when it answers, else over the comm (see serverPath.ts). */
  private async request(kind: 'resize' | 'stop', size?: number): Promise<void> {
    const outcome = await requestRun(this.model.get('run_id'), kind === 'resize' ? 'PATCH' : 'DELETE',
      kind === 'resize' ? { world_size: size } : undefined);
    this.ui.root.dataset.requestPath = outcome.ok || !outcome.fallback ? 'server' : 'comm';
    if (!outcome.ok && outcome.fallback) {
      this.model.send(kind === 'resize' ? { type: 'resize', world_size: size } : { type: 'stop' });
    } else if (!outcome.ok) {
      this.requested = null;
      this.ui.notice.textContent = `${kind} refused: ${outcome.message}`;
      this.showStatus();
    }
  }

  private refreshMetrics(): void {
    const select = this.ui.metric;
    const names = this.history.metricNames.filter(n => n !== 'val_loss');
    if (names.length + 1 === select.options.length) {
      return;
    }
    const chosen = select.value;
    select.replaceChildren(new Option('none', ''), ...names.map(n => new Option(n, n)));
    // by default the first held-out metric (as run.plot() does): evaluations show at once
    select.value = names.includes(chosen) ? chosen : (names.find(n => n.startsWith('val_')) ?? '');
    if (select.value !== chosen) {
      this.chart.setOptions({ metric: select.value || null });
    }
  }

  private showSize(value: number): void {
    this.ui.sliderValue.textContent = String(value);
  }

  private showStatus(): void {
    if (this.restarted) {
      return; // a dead kernel's traits no longer change; keep saying so
    }
    const s = this.model.get('status');
    const { slider, size, state, stop } = this.ui;
    const active = ACTIVE.includes(s.state);
    slider.min = String(this.model.get('min_size'));
    slider.max = String(this.model.get('max_size'));
    if (this.requested !== null && s.requested_size === this.requested) {
      this.requested = null; // the kernel has the request
    }
    const wanted = this.requested ?? s.requested_size;
    if (document.activeElement !== slider) {
      slider.value = String(wanted || s.world_size);
      this.showSize(Number(slider.value));
    }
    slider.disabled = stop.disabled = !active;
    const pending = active && wanted && wanted !== s.world_size;
    const r = s.last_resize;
    size.textContent = pending
      ? `world size ${s.world_size} → ${wanted}: pending…`
      : `world size ${s.world_size}` + (r ? ` (resize ${r.from} → ${r.to} took ${r.latency_s.toFixed(2)} s)` : '');
    size.classList.toggle('ej-pending', Boolean(pending));
    state.textContent = s.state;
    state.dataset.state = s.state;
    this.ui.root.dataset.worldSize = String(s.world_size);
    this.ui.line.textContent = statusLine(s);
    this.ui.reason.textContent = active ? '' : reason(s);
  }

  private showNotice(): void {
    const notice = this.model.get('notice');
    this.ui.notice.textContent = notice;
    if (notice && this.requested !== null) {
      this.requested = null; // the request was refused: nothing is pending
      this.showStatus();
    }
  }

  private checkConnection(): void {
    const live = ACTIVE.includes(this.model.get('status').state) && !this.ended;
    if (live && Date.now() - this.lastBeat > DISCONNECTED_AFTER_MS) {
      this.showDisconnected('no word from the kernel for a while (busy, restarted or shut down)');
    }
  }

  /**
   * JupyterLab and Notebook 7 expose the kernel on the widget manager: a restart is seen at
   * once, even for a run that has ended (no beats to miss then).
   */
  private watchKernel(): () => void {
    const kernel = (this.model as any).widget_manager?.kernel;
    const onStatus = (_: unknown, status: string) => {
      if (['restarting', 'autorestarting', 'dead'].includes(status)) {
        this.restarted = true;
        this.showDisconnected('the kernel restarted or shut down');
      }
    };
    kernel?.statusChanged?.connect(onStatus);
    return () => kernel?.statusChanged?.disconnect(onStatus);
  }

  private showDisconnected(why: string): void {
    this.ui.root.classList.add('ej-disconnected');
    this.ui.slider.disabled = this.ui.stop.disabled = true;
    this.ui.reason.textContent =
      `Disconnected: ${why}. This view is frozen. Re-run the cell, or call run.dashboard() ` +
      '(after %%elastic_train --resume in a new kernel).';
  }
}

function statusLine(s: Status): string {
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
  return parts.join(' · ');
}

function reason(s: Status): string {
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

function legend(): HTMLElement {
  const box = document.createElement('span');
  box.className = 'ej-legend';
  for (const [kind, text] of [['resized', 'resize'], ['fault', 'fault'], ['checkpoint', 'checkpoint']]) {
    const item = document.createElement('span');
    item.className = `ej-mark ej-mark-${kind}`;
    item.textContent = text;
    box.append(item);
  }
  return box;
}

function buildDom(el: HTMLElement) {
  const make = <K extends keyof HTMLElementTagNameMap>(tag: K, cls: string, text = '') => {
    const node = document.createElement(tag);
    node.className = cls;
    node.textContent = text;
    return node;
  };
  const root = make('div', 'ej-dashboard');
  const header = make('div', 'ej-row');
  const title = make('span', 'ej-title');
  const state = make('span', 'ej-state');
  const line = make('span', 'ej-line');
  header.append(title, state, line);

  const controls = make('div', 'ej-row');
  const slider = make('input', 'ej-slider');
  slider.type = 'range';
  slider.step = '1';
  slider.setAttribute('aria-label', 'pool size');
  const sliderValue = make('span', 'ej-slider-value');
  const size = make('span', 'ej-size');
  const stop = make('button', 'ej-button', 'Stop');
  const logsButton = make('button', 'ej-button', 'Logs');
  controls.append(make('span', 'ej-label', 'Pool size'), slider, sliderValue, size, stop, logsButton);

  const options = make('div', 'ej-row ej-options');
  const smoothing = make('input', 'ej-smoothing');
  Object.assign(smoothing, { type: 'range', min: '0', max: '0.99', step: '0.01', value: '0.6' });
  const log = make('input', '');
  log.type = 'checkbox';
  const metric = make('select', 'ej-metric');
  const logLabel = make('label', '', ' log scale');
  logLabel.prepend(log);
  options.append(make('span', 'ej-label', 'Smoothing'), smoothing, logLabel, make('span', 'ej-label', 'Metric'), metric,
    legend());

  const chart = make('div', 'ej-chart-box');
  const reason = make('div', 'ej-reason');
  const notice = make('div', 'ej-notice');
  const logs = make('pre', 'ej-logs');
  logs.hidden = true;
  root.append(header, controls, reason, notice, options, chart, logs);
  el.append(root);
  return { root, title, state, line, slider, sliderValue, size, stop, logsButton, smoothing, log, metric, chart, reason, notice, logs };
}

export default { render };
