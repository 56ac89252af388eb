/**
 * The "Elastic training" side panel: every run of this user, and for the selected one a resize
 * slider with pending -> done feedback, the live loss chart, checkpoints, stop and logs.
 * It polls the server extension while visible and stops while hidden.
 */
import { Widget } from '@lumino/widgets';

import { LossChart } from '../chart/lossChart';
import { ApiError, ElasticApi } from './api';
import {
  Backoff, HistoryCursor, ResizeTracker, RunModel, describeSlots, fingerprint, isActive, sparklinePoints
} from './model';

export interface PanelActions {
  openPath(path: string): Promise<void>; // show a file in the file browser
  confirm(title: string, body: string): Promise<boolean>;
}

const MAX_DELAY_MS = 10_000;
const COALESCE_MS = 150;

export class ElasticPanel extends Widget {
  private runs: RunModel[] = [];
  private selected: string | null = null;
  private trackers = new Map<string, ResizeTracker>();
  private cursor: HistoryCursor | null = null;
  private chart: LossChart | null = null;
  private backoff: Backoff;
  private timer = 0;
  private polling = false;
  private inFlight = false;
  private lastFingerprint = '';
  private resizeTimer = 0;
  private listEl: HTMLElement;
  private detailEl: HTMLElement;
  private messageEl: HTMLElement;
  private detail: ReturnType<typeof buildDetail> | null = null;

  constructor(private api: ElasticApi, private actions: PanelActions, pollMs = 1000) {
    super();
    this.addClass('ejp-panel');
    this.backoff = new Backoff(pollMs, MAX_DELAY_MS);
    const header = el('div', 'ejp-header', 'Elastic training');
    this.messageEl = el('div', 'ejp-message');
    this.listEl = el('ul', 'ejp-runs');
    this.detailEl = el('div', 'ejp-detail');
    this.node.append(header, this.messageEl, this.listEl, this.detailEl);
  }

  set pollInterval(ms: number) {
    this.backoff.base = ms;
    this.backoff.reset();
  }

  /** The runs as last polled (the command palette's commands choose from them). */
  get knownRuns(): RunModel[] {
    return this.runs;
  }

  select(id: string): void {
    this.selected = id;
    this.cursor = null;
    this.detail = null;
    this.chart?.destroy();
    this.chart = null;
    this.render();
    this.refresh();
  }

  /** Poll now (after a request made elsewhere, e.g. from a command). */
  refresh(): void {
    this.backoff.reset();
    if (this.isVisible) {
      this.schedule(0);
    }
  }

  async resize(id: string, size: number): Promise<void> {
    const tracker = this.tracker(id);
    tracker.request(size, Date.now());
    this.render();
    try {
      this.upsert(await this.api.resize(id, size));
    } catch (error) {
      tracker.fail(error instanceof ApiError ? error.message : String(error));
    }
    this.render();
    this.refresh();
  }

  async stop(id: string): Promise<void> {
    const run = this.runs.find(r => r.id === id);
    const ok = await this.actions.confirm('Stop run?', `Stop '${run?.name ?? id}' after its current step? A checkpoint is written first.`);
    if (!ok) {
      return;
    }
    try {
      this.upsert(await this.api.stop(id));
    } catch (error) {
      this.showMessage(error instanceof ApiError ? error.message : String(error));
    }
    this.refresh();
  }

  protected onAfterShow(): void {
    this.polling = true;
    this.refresh();
  }

  protected onAfterHide(): void {
    this.polling = false; // hidden: no polls at all
    window.clearTimeout(this.timer);
  }

  dispose(): void {
    this.polling = false;
    window.clearTimeout(this.timer);
    this.chart?.destroy();
    super.dispose();
  }

  private schedule(delay: number): void {
    window.clearTimeout(this.timer);
    this.timer = window.setTimeout(() => void this.poll(), delay);
  }

  private async poll(): Promise<void> {
    if (!this.polling || this.inFlight) {
      return; // the poll in flight schedules the next one
    }
    this.inFlight = true;
    let changed = false;
    let failed = false;
    try {
      this.runs = await this.api.runs();
      const print = fingerprint(this.runs);
      changed = print !== this.lastFingerprint;
      this.lastFingerprint = print;
      changed = (await this.pollHistory()) || changed;
      this.showMessage('');
    } catch (error) {
      failed = true;
      this.showMessage(`Cannot reach the elastic-jupyter server extension: ${error instanceof Error ? error.message : error}`);
    }
    this.inFlight = false;
    this.render();
    if (this.polling) {
      this.schedule(this.backoff.next(changed, failed));
    }
  }

  private async pollHistory(): Promise<boolean> {
    const run = this.runs.find(r => r.id === this.selected);
    if (!run || run.state === 'lost') {
      return false;
    }
    const cursor = (this.cursor ??= new HistoryCursor());
    const page = await this.api.history(run.id, cursor.since, cursor.eventsSince);
    // another run may have been selected meanwhile: its cursor must not get these rows
    return this.cursor === cursor && this.selected === run.id && cursor.apply(page);
  }

  private upsert(model: RunModel): void {
    this.runs = this.runs.map(r => (r.id === model.id ? { ...r, ...model } : r));
  }

  private tracker(id: string): ResizeTracker {
    let tracker = this.trackers.get(id);
    if (!tracker) {
      tracker = new ResizeTracker();
      this.trackers.set(id, tracker);
    }
    return tracker;
  }

  private showMessage(text: string): void {
    this.messageEl.textContent = text;
  }

  // ------------------------------------------------------------------ rendering

  private render(): void {
    this.listEl.replaceChildren(...this.runs.map(run => this.renderRow(run)));
    if (!this.runs.length) {
      this.listEl.append(el('li', 'ejp-empty', 'No runs yet: start one with %%elastic_train in a notebook.'));
    }
    const run = this.runs.find(r => r.id === this.selected);
    if (!run) {
      this.detailEl.replaceChildren();
      this.detail = null;
      return;
    }
    this.detail ??= this.buildDetail(run);
    this.updateDetail(run);
  }

  private renderRow(run: RunModel): HTMLElement {
    const row = el('li', 'ejp-run');
    row.dataset.runId = run.id;
    row.dataset.state = run.state;
    row.classList.toggle('ejp-selected', run.id === this.selected);
    const sizes = isActive(run) ? `W ${run.world_size}/${run.requested_size || run.world_size}` : '';
    const loss = run.loss === null || run.loss === undefined ? '' : `loss ${run.loss.toFixed(4)}`;
    const spark = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
    spark.setAttribute('class', 'ejp-spark');
    spark.setAttribute('viewBox', '0 0 80 20');
    const line = document.createElementNS('http://www.w3.org/2000/svg', 'polyline');
    line.setAttribute('points', sparklinePoints(run.recent_loss ?? [], 80, 20));
    spark.append(line);
    row.append(
      el('div', 'ejp-row', '', [el('span', 'ejp-name', run.name), el('span', 'ejp-state', run.state)]),
      el('div', 'ejp-row ejp-dim', '', [
        el('span', '', [sizes, `step ${run.step}${run.total_steps ? '/' + run.total_steps : ''}`, loss].filter(Boolean).join(' · ')),
        spark
      ]),
      el('div', 'ejp-dim ejp-where', [basename(run.notebook), isActive(run) ? describeSlots(run.slots) : ''].filter(Boolean).join(' · '))
    );
    row.title = run.notebook ?? '';
    row.addEventListener('click', () => this.select(run.id));
    return row;
  }

  private buildDetail(run: RunModel) {
    const d = buildDetail();
    this.detailEl.replaceChildren(d.root);
    d.slider.addEventListener('input', () => (d.value.textContent = d.slider.value));
    d.slider.addEventListener('change', () => {
      window.clearTimeout(this.resizeTimer); // quick moves (keyboard): only the last is sent
      const size = Number(d.slider.value);
      this.resizeTimer = window.setTimeout(() => void this.resize(run.id, size), COALESCE_MS);
    });
    d.stop.addEventListener('click', () => void this.stop(run.id));
    d.logsButton.addEventListener('click', async () => {
      d.logs.hidden = !d.logs.hidden;
      if (!d.logs.hidden) {
        d.logs.textContent = await this.api.logs(run.id).catch(e => String(e));
      }
    });
    return d;
  }

  private updateDetail(run: RunModel): void {
    const d = this.detail!;
    const active = isActive(run);
    d.root.dataset.worldSize = String(run.world_size);
    d.title.textContent = run.name;
    d.controls.hidden = !active;
    d.slider.min = String(run.min_size ?? 1);
    d.slider.max = String(run.max_size ?? run.world_size);
    if (document.activeElement !== d.slider) {
      d.slider.value = String(run.requested_size || run.world_size);
      d.value.textContent = d.slider.value;
    }
    const feedback = this.tracker(run.id).update(run, Date.now());
    d.feedback.textContent = feedback.text || `world size ${run.world_size}`;
    d.feedback.dataset.kind = feedback.kind;
    d.reason.textContent = active ? '' : run.error || `The run has ${run.state}.`;
    d.checkpoints.replaceChildren(...run.checkpoints.slice().reverse().map(c => {
      const item = el('li', '');
      const label = `step ${c.step} · ${new Date(c.time * 1000).toLocaleTimeString()} · ${(c.bytes / 1e6).toFixed(2)} MB`;
      if (c.browser_path) {
        const link = el('a', 'ejp-link', label) as HTMLAnchorElement;
        link.href = '#';
        link.title = c.path;
        link.addEventListener('click', e => {
          e.preventDefault();
          this.actions.openPath(c.browser_path!).catch(error => this.showMessage(`Cannot show ${c.path}: ${error}`));
        });
        item.append(link);
      } else {
        item.textContent = `${label} · ${c.path}`;
      }
      return item;
    }));
    if (this.cursor && run.state !== 'lost') {
      this.chart ??= new LossChart(d.chart, { smoothing: 0.6, log: false, metric: null, compact: true });
      this.chart.setHistory(this.cursor.history);
      this.chart.setMarkers(this.cursor.events);
    }
  }
}

function basename(path: string | null): string {
  return path ? path.split('/').pop() ?? path : '';
}

function el(tag: string, cls: string, text = '', children: Node[] = []): HTMLElement {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  node.textContent = text;
  node.append(...children);
  return node;
}

function buildDetail() {
  const root = el('div', 'ejp-detail-box');
  const title = el('h3', 'ejp-title');
  const slider = el('input', 'ejp-slider') as HTMLInputElement;
  slider.type = 'range';
  slider.step = '1';
  slider.setAttribute('aria-label', 'pool size');
  const value = el('span', 'ejp-value');
  const stop = el('button', 'jp-Button jp-mod-styled jp-mod-warn ejp-stop', 'Stop') as HTMLButtonElement;
  const controls = el('div', 'ejp-controls', '', [el('span', 'ejp-dim', 'Pool size'), slider, value, stop]);
  const feedback = el('div', 'ejp-feedback');
  const reason = el('div', 'ejp-reason');
  const chart = el('div', 'ejp-chart');
  const checkpoints = el('ul', 'ejp-checkpoints');
  const logsButton = el('button', 'jp-Button jp-mod-styled ejp-logs-button', 'Logs') as HTMLButtonElement;
  const logs = el('pre', 'ejp-logs');
  logs.hidden = true;
  root.append(title, controls, feedback, reason, chart, el('div', 'ejp-dim', 'Checkpoints'), checkpoints, logsButton, logs);
  return { root, title, slider, value, stop, controls, feedback, reason, chart, checkpoints, logsButton, logs };
}
