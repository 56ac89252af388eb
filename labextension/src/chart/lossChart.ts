/**
 * The live loss chart shared by the notebook dashboard and the side panel, drawn with uPlot
 * (https://github.com/leeoniya/uPlot: canvas, ~50 KB, draws 100k-point series in milliseconds).
 *
 * Per-step training loss (faint) under its debiased moving average, validation loss as points,
 * one selectable extra metric on its own axis, the world size as a step line on the right axis,
 * faint epoch boundaries and a vertical marker at every resize, fault and checkpoint. Colours
 * of text and grid come from JupyterLab's --jp-* CSS variables, so light and dark themes work.
 */
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';

import { Column, History, ema } from './history';

export interface Marker {
  kind: string;
  step: number;
  [field: string]: unknown;
}

export interface ChartOptions {
  smoothing: number; // moving-average weight in [0, 1); 0 = raw loss only
  log: boolean;
  metric: string | null; // extra series drawn on its own axis
  compact?: boolean; // narrow places (the side panel): no legend, no axis titles, small axes
}

const MARKER_STYLE: Record<string, { colour: string; dash: number[] }> = {
  resized: { colour: '#2ca02c', dash: [6, 3] },
  fault: { colour: '#d62728', dash: [] },
  checkpoint: { colour: '#8c8c8c', dash: [2, 3] },
  slot: { colour: '#9467bd', dash: [1, 2] }, // the machine's arbiter moved a slot: labelled
  drain: { colour: '#ff7f0e', dash: [4, 2, 1, 2] } // a scheduler told a rank to go: labelled
};
const LABELLED = new Set(['slot', 'drain']);
const MAX_EPOCH_LINES = 50;
const LOSS = '31, 119, 180';
const VAL = '#ff7f0e';
const WORLD = '#9467bd';
const METRIC = '#17becf';

export class LossChart {
  private plot: uPlot | null = null;
  private markers: Marker[] = [];
  private history = new History();
  private layoutKey = '';
  private zoomed = false; // the user zoomed in: new data must not reset the x range
  private resizeObserver: ResizeObserver;
  private themeObserver: MutationObserver;

  /** `onZoom(from, to)` is called with the step range the user zoomed to (null on reset). */
  constructor(
    private el: HTMLElement,
    private options: ChartOptions,
    private onZoom: (range: [number, number] | null) => void = () => undefined
  ) {
    el.classList.add('ej-chart');
    this.resizeObserver = new ResizeObserver(() => this.fit());
    this.resizeObserver.observe(el);
    // JupyterLab switches themes by changing attributes on <body>: rebuild with new colours
    this.themeObserver = new MutationObserver(() => this.rebuild());
    this.themeObserver.observe(document.body, { attributeFilter: ['data-jp-theme-name', 'data-jp-theme-light'] });
  }

  setOptions(options: Partial<ChartOptions>): void {
    this.options = { ...this.options, ...options };
    this.draw();
  }

  setMarkers(markers: Marker[]): void {
    this.markers = markers.filter(m => m.kind in MARKER_STYLE);
    this.plot?.redraw(false, false);
    for (const kind of Object.keys(MARKER_STYLE)) { // read by the browser tests
      this.el.dataset[`markers${kind[0].toUpperCase()}${kind.slice(1)}`] =
        String(this.markers.filter(m => m.kind === kind).length);
    }
  }

  /** Draw `history` (kept by reference: call again after it changed). */
  setHistory(history: History): void {
    this.history = history;
    this.draw();
  }

  destroy(): void {
    this.resizeObserver.disconnect();
    this.themeObserver.disconnect();
    this.plot?.destroy();
    this.plot = null;
  }

  private draw(): void {
    const { series, data, key } = this.build();
    if (!this.plot || key !== this.layoutKey) {
      this.plot?.destroy();
      this.layoutKey = key;
      this.plot = new uPlot(this.plotOptions(series), data, this.el);
    } else {
      this.plot.setData(data, !this.zoomed);
    }
    this.el.dataset.points = String(this.history.length);
  }

  private rebuild(): void {
    this.layoutKey = '';
    this.draw();
  }

  private fit(): void {
    if (this.plot && this.el.clientWidth > 0) {
      this.plot.setSize({ width: this.el.clientWidth, height: this.height() });
    }
  }

  private height(): number {
    return this.options.compact ? 170 : Math.max(180, Math.min(320, Math.round(this.el.clientWidth * 0.4)));
  }

  private build(): { series: uPlot.Series[]; data: uPlot.AlignedData; key: string } {
    const h = this.history;
    const { smoothing, log, metric } = this.options;
    const loss = h.column('loss');
    const series: uPlot.Series[] = [{ label: 'step' }];
    const data: Column[] = [h.column('step')];
    const add = (s: uPlot.Series, values: Column) => {
      series.push(s);
      data.push(values);
    };
    if (smoothing > 0) {
      add({ label: 'loss (raw)', stroke: `rgba(${LOSS}, 0.3)`, width: 1, scale: 'y' }, loss);
      add({ label: 'loss (smoothed)', stroke: `rgb(${LOSS})`, width: 2, scale: 'y' }, ema(loss, smoothing));
    } else {
      add({ label: 'loss', stroke: `rgb(${LOSS})`, width: 1.5, scale: 'y' }, loss);
    }
    if (h.columns.has('val_loss')) {
      add(points('validation loss', VAL, 'y'), h.column('val_loss'));
    }
    if (metric && h.columns.has(metric)) {
      const values = h.column(metric);
      const sparse = values.filter(v => v !== null).length < values.length / 2;
      add(sparse ? points(metric, METRIC, 'metric') : { label: metric, stroke: METRIC, width: 1.5, scale: 'metric' }, values);
    }
    add({ label: 'world size', stroke: WORLD, width: 1.5, scale: 'world', paths: uPlot.paths.stepped!({ align: 1 }) }, h.column('world_size'));
    const key = JSON.stringify([series.map(s => s.label), log]);
    return { series, data: data as uPlot.AlignedData, key };
  }

  private plotOptions(series: uPlot.Series[]): uPlot.Options {
    const style = getComputedStyle(this.el);
    const text = style.getPropertyValue('--jp-ui-font-color1').trim() || '#333';
    const grid = style.getPropertyValue('--jp-border-color2').trim() || '#ddd';
    const font = `11px ${style.getPropertyValue('--jp-ui-font-family').trim() || 'sans-serif'}`;
    const compact = Boolean(this.options.compact);
    const axis = (scale: string, label: string, side = 3, showGrid = true): uPlot.Axis => ({
      scale, side, stroke: text, font, labelFont: font,
      ...(compact ? { size: side === 2 ? 24 : 34, gap: 2 } : { label }),
      grid: { show: showGrid, stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1, size: compact ? 4 : 10 }
    });
    const hasMetric = series.some(s => s.scale === 'metric');
    return {
      width: Math.max(this.el.clientWidth, this.options.compact ? 150 : 300),
      height: this.height(),
      series,
      scales: {
        x: { time: false },
        y: { distr: this.options.log ? 3 : 1 },
        world: { range: (_u, _min, max) => [0, Math.max(max ?? 1, 1) + 1] }
      },
      axes: [
        axis('x', 'step', 2),
        axis('y', 'loss'),
        { ...axis('world', 'world size', 1, false), incrs: [1, 2, 5, 10] },
        ...(hasMetric ? [axis('metric', this.options.metric ?? '', 1, false)] : [])
      ],
      cursor: { drag: { x: true, y: false } },
      legend: { show: !compact, live: true },
      hooks: {
        draw: [u => this.drawOverlays(u)],
        setScale: [(u, key) => key === 'x' && this.reportZoom(u)]
      }
    };
  }

  private reportZoom(u: uPlot): void {
    const { min, max } = u.scales.x;
    const steps = this.history.column('step');
    const full = !steps.length || (min! <= (steps[0] as number) && max! >= this.history.lastStep);
    this.zoomed = !full;
    this.onZoom(full ? null : [Math.floor(min!), Math.ceil(max!)]);
  }

  /** Epoch boundaries (faint) and resize / fault / checkpoint markers, over the plot area. */
  private drawOverlays(u: uPlot): void {
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    const line = (step: number, colour: string, dash: number[], lineWidth: number) => {
      const x = Math.round(u.valToPos(step, 'x', true));
      if (x < left || x > left + width) {
        return;
      }
      ctx.strokeStyle = colour;
      ctx.setLineDash(dash);
      ctx.lineWidth = lineWidth;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    };
    ctx.save();
    const steps = this.history.column('step');
    const epochs = this.history.column('epoch');
    const epochColour = getComputedStyle(this.el).getPropertyValue('--jp-border-color1').trim() || '#bbb';
    const starts: number[] = [];
    for (let i = 1; i < epochs.length; i++) {
      if (epochs[i] !== epochs[i - 1]) {
        starts.push(steps[i] as number);
      }
    }
    ctx.globalAlpha = 0.25;
    for (const step of starts.length <= MAX_EPOCH_LINES ? starts : []) {
      line(step, epochColour, [], 1); // beyond MAX_EPOCH_LINES they would grey the plot out
    }
    ctx.globalAlpha = 0.9;
    ctx.font = `${10 * devicePixelRatio}px sans-serif`;
    for (const m of this.markers) {
      const { colour, dash } = MARKER_STYLE[m.kind];
      line(m.step, colour, dash, 1.5 * devicePixelRatio);
      if (LABELLED.has(m.kind) && typeof m.message === 'string') { // "grew into GPU 3 (freed by run b)"
        ctx.fillStyle = colour;
        ctx.fillText(m.message, Math.round(u.valToPos(m.step, 'x', true)) + 3, top + 12 * devicePixelRatio);
      }
    }
    ctx.restore();
  }
}

function points(label: string, colour: string, scale: string): uPlot.Series {
  return { label, stroke: colour, fill: colour, scale, paths: () => null, points: { show: true, size: 6 } };
}
