/**
 * A run's per-step history held as columns aligned on `step` (the front-end twin of
 * elastic_jupyter/series.py). Missing values (an evaluation metric between evaluations) are null.
 */
export type Column = (number | null)[];

export const BASE_COLUMNS = ['step', 'epoch', 'loss', 'world_size', 'samples_per_s', 'time'];

export class History {
  readonly columns = new Map<string, Column>();

  get length(): number {
    return this.column('step').length;
  }

  get lastStep(): number {
    const steps = this.column('step');
    return steps.length ? (steps[steps.length - 1] as number) : 0;
  }

  /** Extra metrics (from loss_fn) and val_* metrics, in first-seen order. */
  get metricNames(): string[] {
    return [...this.columns.keys()].filter(n => !BASE_COLUMNS.includes(n));
  }

  column(name: string): Column {
    let col = this.columns.get(name);
    if (!col) {
      col = new Array(this.columns.get('step')?.length ?? 0).fill(null);
      this.columns.set(name, col);
    }
    return col;
  }

  /** Replace everything with a snapshot `{columns: [...], data: [[...], ...]}`. */
  load(names: string[], data: Column[]): void {
    this.columns.clear();
    names.forEach((name, i) => this.columns.set(name, data[i].slice()));
  }

  /**
   * Append rows given as one float64 buffer per column (NaN = missing), as the dashboard's
   * binary messages carry them. Returns the number of rows added.
   */
  appendBinary(names: string[], buffers: DataView[], after?: number): number {
    return this.appendColumns(names, names.map((_, i) => decode(buffers[i])), after);
  }

  /**
   * Append rows given column by column; rows at or before the last held step are skipped
   * (another view's request, or an overlapping poll, may repeat them). With `after` (the step
   * the sender assumed held), a gap appends nothing and returns -1: ask for the missing rows.
   */
  appendColumns(names: string[], data: Column[], after?: number): number {
    if (after !== undefined && after > this.lastStep) {
      return -1;
    }
    const incoming = new Map(names.map((n, i) => [n, data[i]]));
    const steps = incoming.get('step') ?? [];
    const last = this.lastStep;
    const first = steps.findIndex(s => (s as number) > last);
    if (first < 0) {
      return 0;
    }
    const before = this.length;
    for (const name of new Set([...this.columns.keys(), ...names])) {
      const col = this.column(name);
      col.length = before; // a column first seen now was created at the current length
      const values = incoming.get(name);
      for (let i = first; i < steps.length; i++) {
        col.push(values ? values[i] : null);
      }
    }
    return steps.length - first;
  }

  /** Drop the rows after `step` (a fault rolled the run back to it). */
  truncate(step: number): void {
    const steps = this.column('step');
    let keep = steps.length;
    while (keep > 0 && (steps[keep - 1] as number) > step) {
      keep--;
    }
    for (const col of this.columns.values()) {
      col.length = keep;
    }
  }

  /** Replace the rows with steps in [from, to] by full-resolution rows (a zoom request). */
  spliceRange(from: number, to: number, names: string[], buffers: DataView[]): void {
    const incoming = new Map(names.map((n, i) => [n, decode(buffers[i])]));
    const steps = this.column('step');
    const start = lowerBound(steps, from);
    const end = lowerBound(steps, to + 1);
    const count = (incoming.get('step') ?? []).length;
    for (const name of new Set([...this.columns.keys(), ...names])) {
      const col = this.column(name);
      const values = incoming.get(name) ?? new Array(count).fill(null);
      this.columns.set(name, col.slice(0, start).concat(values, col.slice(end))); // no spread: 50k rows
    }
  }

  /** Number of rows with steps in [from, to]. */
  rowsIn(from: number, to: number): number {
    const steps = this.column('step');
    return lowerBound(steps, to + 1) - lowerBound(steps, from);
  }
}

/** A little-endian float64 buffer as a column (NaN -> null). */
function decode(view: DataView): Column {
  // read value by value: a buffer sliced out of a websocket frame need not be 8-byte aligned
  const col: Column = new Array(view.byteLength / 8);
  for (let j = 0; j < col.length; j++) {
    const v = view.getFloat64(j * 8, true);
    col[j] = Number.isNaN(v) ? null : v;
  }
  return col;
}

function lowerBound(steps: Column, value: number): number {
  let lo = 0;
  let hi = steps.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if ((steps[mid] as number) < value) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/**
 * Debiased exponential moving average, as TensorBoard smooths scalars: the same formula as
 * elastic_jupyter.series.ema (bias correction of Adam, Kingma & Ba 2015). Nulls stay null.
 */
export function ema(values: Column, weight: number): Column {
  let acc = 0;
  let n = 0;
  return values.map(x => {
    if (x === null) {
      return null;
    }
    n++;
    acc = weight * acc + (1 - weight) * x;
    return acc / (1 - Math.pow(weight, n));
  });
}
