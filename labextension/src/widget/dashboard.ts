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
import { ApiError, RunsClient } from '../common/api';
import { ResizeTracker, SLIDER_DEBOUNCE_MS } from '../common/resize';
import { RunSnapshot, isActive, sliderMax, toSnapshot } from '../common/snapshot';
import { pageRequester, readPageConfig } from './pageRequester';
import { buildDom, reason, sizeText, statusLine } from './view';
import './dashboard.css';

interface Model {
  name: string;
  run_id: string | null;
  min_size: number;
  max_size: number;
  status: object; // a RunSnapshot (older Python sides: a subset, see toSnapshot)
  events: Marker[];
  history: { columns?: string[]; data?: (number | null)[][]; decimated?: boolean };
  notice: string;
}

const DISCONNECTED_AFTER_MS = 4000; // the kernel sends a beat every second

function render({ model, el }: RenderProps<Model>): () => void {
  const view = new DashboardView(model, el);
  return () => view.dispose();
}

class DashboardView {
  private history = new History();
  private chart: LossChart;
  private ui: ReturnType<typeof buildDom>;
  private tracker = new ResizeTracker();
  private client = new RunsClient(pageRequester(readPageConfig(), () => document.cookie));
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
    this.loadHistory();
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

  private loadHistory(): void {
    const initial = this.model.get('history');
    if (initial.columns && initial.data) {
      this.history.load(initial.columns, initial.data);
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
    const { slider, stop, auto, logsButton, smoothing, log, metric } = this.ui;
    auto.addEventListener('change', () => void this.request('auto', undefined, auto.checked));
    slider.addEventListener('input', () => this.showSize(Number(slider.value)));
    slider.addEventListener('change', () => {
      const size = Number(slider.value);
      window.clearTimeout(this.resizeTimer); // quick moves (keyboard): only the last is sent
      if (this.tracker.request(size, this.snapshot(), Date.now())) {
        this.resizeTimer = window.setTimeout(
          () => void this.request('resize', size),
          SLIDER_DEBOUNCE_MS
        );
      }
      this.showStatus();
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

  /** The run as the kernel last described it. */
  private snapshot(): RunSnapshot {
    const m = this.model;
    return toSnapshot(m.get('status'), { id: m.get('run_id'), name: m.get('name'), min_size: m.get('min_size'), max_size: m.get('max_size') });
  }

  /**
   * Over the server extension, so the request never waits for the kernel's shell; over the
   * comm where the server cannot carry it out (no extension, VS Code, run unreachable).
   */
  private async request(kind: 'resize' | 'stop' | 'auto', size?: number, on?: boolean): Promise<void> {
    const id = this.model.get('run_id');
    let error: ApiError | null = null;
    try {
      if (!id) {
        throw new ApiError(0, 'no run id');
      }
      await (kind === 'resize' ? this.client.resize(id, size!) : kind === 'auto' ? this.client.setAuto(id, on!) : this.client.stop(id));
    } catch (e) {
      error = e instanceof ApiError ? e : new ApiError(0, String(e));
    }
    this.ui.root.dataset.requestPath = error?.fallback ? 'comm' : 'server';
    if (error?.fallback) {
      this.model.send(kind === 'resize' ? { type: 'resize', world_size: size } : kind === 'auto' ? { type: 'auto', auto: on } : { type: 'stop' });
    } else if (error && kind === 'resize') {
      this.tracker.fail(`resize refused: ${error.message}`);
      this.showStatus();
    } else if (error) {
      this.ui.notice.textContent = `${kind} refused: ${error.message}`;
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
    const s = this.snapshot();
    const { slider, size, state, stop } = this.ui;
    const active = isActive(s);
    slider.min = String(s.min_size ?? 1);
    slider.max = String(sliderMax(s));
    this.ui.autoLabel.hidden = !s.lease;
    this.ui.auto.checked = s.lease?.auto ?? false;
    this.ui.auto.disabled = !active;
    const feedback = this.tracker.update(s, Date.now());
    if (document.activeElement !== slider) {
      slider.value = String(this.tracker.pending ?? (s.requested_size || s.world_size));
      this.showSize(Number(slider.value));
    }
    slider.disabled = stop.disabled = !active;
    size.textContent = sizeText(s, feedback);
    size.dataset.kind = feedback.kind;
    size.classList.toggle('ej-pending', feedback.kind === 'pending');
    state.textContent = s.state;
    state.dataset.state = s.state;
    this.ui.root.dataset.worldSize = String(s.world_size);
    this.ui.line.textContent = statusLine(s);
    this.ui.reason.textContent = active ? '' : reason(s);
  }

  private showNotice(): void {
    const notice = this.model.get('notice');
    this.ui.notice.textContent = notice;
    if (notice && this.tracker.pending !== null) {
      this.tracker.fail(notice); // the kernel refused the request sent over the comm
      this.showStatus();
    }
  }

  private checkConnection(): void {
    const live = isActive(this.snapshot()) && !this.ended;
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

export default { render };
