/**
 * The "Elastic training" side panel: every run of this user, and for the selected one a resize
 * slider with pending -> done feedback, the live loss chart, checkpoints, stop and logs.
 * It polls the server extension while visible and stops while hidden.
 */
import { Widget } from '@lumino/widgets';

import { LossChart } from '../chart/lossChart';
import { ApiError, RunsClient } from '../common/api';
import { h } from '../common/dom';
import { ResizeTracker, SLIDER_DEBOUNCE_MS } from '../common/resize';
import { RunSnapshot, isActive, isEnded } from '../common/snapshot';
import { MachineView, describeExcluded, describeQueued, sliderMax } from '../common/snapshot';
import { HistoryCursor, RunList, describeLease } from './model';
import { ChangePoll } from './poller';
import { buildDetail, renderCheckpoints, renderMachine, renderRow } from './view';

export interface PanelActions {
  openPath(path: string): Promise<void>; // show a file in the file browser
  confirm(title: string, body: string): Promise<boolean>;
}

export class ElasticPanel extends Widget {
  private list = new RunList();
  private selected: string | null = null;
  private trackers = new Map<string, ResizeTracker>();
  private cursor: HistoryCursor | null = null;
  private chart: LossChart | null = null;
  private poller: ChangePoll;
  private resizeTimer = 0;
  private listEl: HTMLElement;
  private detailEl: HTMLElement;
  private machineEl: HTMLElement;
  private machine: MachineView | null = null;
  private messageEl: HTMLElement;
  private detail: ReturnType<typeof buildDetail> | null = null;

  constructor(private api: RunsClient, private actions: PanelActions, pollMs = 1000) {
    super();
    this.addClass('ejp-panel');
    this.poller = new ChangePoll(() => this.poll(), pollMs);
    this.messageEl = h('div', { class: 'ejp-message' });
    this.listEl = h('ul', { class: 'ejp-runs' });
    this.detailEl = h('div', { class: 'ejp-detail' });
    this.machineEl = h('div', { class: 'ejp-machine-body' });
    const machine = h('details', { class: 'ejp-machine', open: true }, h('summary', { class: 'ejp-dim' }, 'Machine'), this.machineEl);
    this.node.append(h('div', { class: 'ejp-header' }, 'Elastic training'), this.messageEl, this.listEl, this.detailEl, machine);
  }

  set pollInterval(ms: number) {
    this.poller.interval = ms;
  }

  /** The runs as last polled (the command palette's commands choose from them). */
  get knownRuns(): RunSnapshot[] {
    return this.list.runs;
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
    if (this.isVisible) {
      this.poller.refresh(); // hidden: the next show polls
    }
  }

  async resize(id: string, size: number): Promise<void> {
    const run = this.list.find(id);
    const tracker = this.tracker(id);
    // a run not polled yet (a command while the panel is hidden) is sent without feedback
    if (run && !tracker.request(size, run, Date.now())) {
      this.render(); // "already N": nothing to send
      return;
    }
    this.render();
    try {
      this.list.upsert(await this.api.resize(id, size));
    } catch (error) {
      tracker.fail(error instanceof ApiError ? error.message : String(error));
    }
    this.render();
    this.refresh();
  }

  async setAuto(id: string, auto: boolean): Promise<void> {
    try {
      this.list.upsert(await this.api.setAuto(id, auto));
    } catch (error) {
      this.showMessage(error instanceof ApiError ? error.message : String(error));
    }
    this.render();
    this.refresh();
  }

  async stop(id: string): Promise<void> {
    const run = this.list.find(id);
    const ok = await this.actions.confirm('Stop run?', `Stop '${run?.name ?? id}' after its current step? A checkpoint is written first.`);
    if (!ok) {
      return;
    }
    try {
      this.list.upsert(await this.api.stop(id));
    } catch (error) {
      this.showMessage(error instanceof ApiError ? error.message : String(error));
    }
    this.refresh();
  }

  /** Forget an ended run: it leaves the list (its checkpoints stay on disk). */
  async dismiss(id: string): Promise<void> {
    try {
      await this.api.dismiss(id);
    } catch (error) {
      this.showMessage(`Cannot dismiss the run: ${error instanceof Error ? error.message : error}`);
      return;
    }
    this.list.remove(id);
    this.trackers.delete(id);
    if (this.selected === id) {
      this.selected = null;
      this.chart?.destroy();
      this.chart = null;
      this.cursor = null;
    }
    this.render();
  }

  protected onAfterShow(): void {
    this.poller.start();
    this.refresh();
  }

  protected onAfterHide(): void {
    this.poller.stop(); // hidden: no polls at all
  }

  dispose(): void {
    this.poller.dispose();
    window.clearTimeout(this.resizeTimer);
    this.chart?.destroy();
    super.dispose();
  }

  /** One poll: the runs, then the selected run's history; whether anything changed. */
  private async poll(): Promise<boolean> {
    let changed: boolean;
    try {
      const token = this.list.begin();
      changed = this.list.apply(await this.api.runs(), token);
      changed = (await this.pollHistory()) || changed;
      changed = (await this.pollMachine().catch(error => {
        // an older server extension, or one that cannot ask the arbiter: the runs still show
        this.machine = { available: false, message: `The machine's view is unavailable: ${error instanceof Error ? error.message : error}` };
        return false;
      })) || changed;
      this.showMessage('');
    } catch (error) {
      this.showMessage(`Cannot reach the elastic-jupyter server extension: ${error instanceof Error ? error.message : error}`);
      throw error; // the Poll backs off
    } finally {
      this.render();
    }
    return changed;
  }

  private async pollHistory(): Promise<boolean> {
    const run = this.list.find(this.selected);
    if (!run?.id || run.state === 'lost') {
      return false;
    }
    const cursor = (this.cursor ??= new HistoryCursor());
    const page = await this.api.history(run.id, cursor.since, cursor.eventsSince);
    // another run may have been selected meanwhile: its cursor must not get these rows
    return this.cursor === cursor && this.selected === run.id && cursor.apply(page);
  }

  /** The machine's view; whether it changed (its slots' holders and the runs' shares). */
  private async pollMachine(): Promise<boolean> {
    const view = await this.api.machine();
    const print = (v: MachineView | null) => JSON.stringify([v?.available, v?.slots?.map(s => [s.holder?.run, s.outside]), v?.runs?.map(r => [r.held, r.target, r.auto, r.queued])]);
    const changed = print(view) !== print(this.machine);
    this.machine = view;
    return changed;
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
    const runs = this.list.runs;
    this.listEl.replaceChildren(...runs.map(run => renderRow(run, run.id === this.selected, {
      select: () => run.id && this.select(run.id),
      dismiss: isEnded(run) && run.id ? () => void this.dismiss(run.id!) : null
    })));
    if (!runs.length) {
      this.listEl.append(h('li', { class: 'ejp-empty' }, 'No runs yet: start one with %%elastic_train in a notebook.'));
    }
    if (this.machine) {
      this.machineEl.replaceChildren(...renderMachine(this.machine, Date.now() / 1000));
    }
    const run = this.list.find(this.selected);
    if (!run) {
      this.detailEl.replaceChildren();
      this.detail = null;
      return;
    }
    this.detail ??= this.buildDetail(run.id!);
    this.updateDetail(run);
  }

  private buildDetail(id: string) {
    const d = buildDetail();
    this.detailEl.replaceChildren(d.root);
    d.slider.addEventListener('input', () => (d.value.textContent = d.slider.value));
    d.slider.addEventListener('change', () => {
      window.clearTimeout(this.resizeTimer); // quick moves (keyboard): only the last is sent
      const size = Number(d.slider.value);
      this.resizeTimer = window.setTimeout(() => void this.resize(id, size), SLIDER_DEBOUNCE_MS);
    });
    d.stop.addEventListener('click', () => void this.stop(id));
    d.auto.addEventListener('change', () => void this.setAuto(id, d.auto.checked));
    d.logsButton.addEventListener('click', async () => {
      d.logs.hidden = !d.logs.hidden;
      if (!d.logs.hidden) {
        d.logs.textContent = await this.api.logs(id).catch(e => String(e));
      }
    });
    return d;
  }

  private updateDetail(run: RunSnapshot): void {
    const d = this.detail!;
    const active = isActive(run);
    const tracker = this.tracker(run.id!);
    d.root.dataset.worldSize = String(run.world_size);
    d.title.textContent = run.name;
    d.controls.hidden = !active;
    d.slider.min = String(run.min_size ?? 1);
    d.slider.max = String(sliderMax(run));
    d.autoLabel.hidden = !run.lease;
    d.auto.checked = run.lease?.auto ?? false;
    d.leaseInfo.textContent = [describeLease(run.lease), describeQueued(run), describeExcluded(run, Date.now())].filter(Boolean).join(' · ');
    if (document.activeElement !== d.slider) {
      d.slider.value = String(tracker.pending ?? (run.requested_size || run.world_size));
      d.value.textContent = d.slider.value;
    }
    const feedback = tracker.update(run, Date.now());
    d.feedback.textContent = feedback.text || `world size ${run.world_size}`;
    d.feedback.dataset.kind = feedback.kind;
    d.reason.textContent = active ? '' : run.error || `The run has ${run.state}.`;
    d.checkpoints.replaceChildren(...renderCheckpoints(run, path =>
      this.actions.openPath(path).catch(error => this.showMessage(`Cannot show ${path}: ${error}`))));
    if (this.cursor && run.state !== 'lost') {
      this.chart ??= new LossChart(d.chart, { smoothing: 0.6, log: false, metric: null, compact: true });
      this.chart.setHistory(this.cursor.history);
      this.chart.setMarkers(this.cursor.events);
    }
  }
}
