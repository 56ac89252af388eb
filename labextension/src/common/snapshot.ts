/**
 * One run as every view sees it: the server extension's REST model (GET elastic/api/runs/<id>)
 * and the dashboard widget's `status` trait carry this same object (written on the Python side).
 */

export type RunState = 'starting' | 'training' | 'resizing' | 'finished' | 'failed' | 'stopped' | 'lost' | 'unresponsive';

/** States in which the run trains and takes resize and stop requests. */
export const ACTIVE_STATES: readonly RunState[] = ['starting', 'training', 'resizing'];

/** States a run never leaves: the panel offers to dismiss such a run from its list. */
export const ENDED_STATES: readonly RunState[] = ['finished', 'failed', 'stopped', 'lost'];

export interface Checkpoint {
  file: string;
  path: string;
  step: number;
  bytes: number;
  time: number;
  browser_path?: string | null; // relative to the server root, null when outside it (REST only)
}

/**
 * The life of the latest resize. `pending` from when the run ends its generation to carry it
 * out until the first completed step at the new size; then `step` is that step and
 * `latency_s` the seconds from the request to it.
 */
export interface ResizeLife {
  from: number;
  to: number;
  step: number;
  requested_time: number;
  pending: boolean;
  latency_s: number | null;
}

/** The pool's lease from the machine's arbiter (pools in lease mode; else the snapshot has null). */
export interface LeaseState {
  auto: boolean;
  weight: number;
  slots: number[]; // training slots leased
  standby: number[];
  target: number;
  queued: number | null; // place in the machine's queue, 1 next
  grantable: number; // the most slots the arbiter could grant now: the slider's range
  lend?: boolean; // false: the pool keeps its slots while idle (--no-lend)
  lent?: { slot: number; to: string; user: string }[]; // its slots other runs hold while it is idle
}

/** The machine as its arbiter sees it (GET elastic/api/machine). */
export interface MachineView {
  available: boolean;
  message?: string;
  kind?: string; // "gpu" or "cpu"
  time?: number;
  slots?: {
    slot: number;
    holder: {
      run: string; name: string; user: string; notebook: string; since: number; standby: boolean;
      lent_by?: { name: string; user: string } | null; // an idle pool lent this slot to the holder
    } | null;
    outside: string | null;
    util?: number;
    memory_mib?: number;
  }[];
  runs?: { run: string; name: string; user: string; notebook: string; auto: boolean; weight: number; min: number; max: number; held: number; target: number; queued: number | null }[];
}

/** A slot left out of engine starts: why, and until when (s since the epoch; null: for good). */
export interface Exclusion {
  slot: number;
  reason: string;
  until: number | null;
}

export interface RunSnapshot {
  id: string | null;
  name: string;
  notebook: string | null;
  kernel_id?: string | null;
  started?: number | null;
  state: RunState;
  step: number;
  total_steps: number | null;
  epoch: number | null;
  world_size: number;
  requested_size: number; // the newest request; differs from world_size until the run takes it up
  min_size: number | null;
  max_size: number | null;
  backend: string | null;
  loss: number | null;
  recent_loss: (number | null)[]; // null where the loss was not finite
  samples_per_s: number | null;
  eta_s: number | null;
  error: string | null;
  checkpoint_dir: string;
  checkpoints: Checkpoint[];
  last_checkpoint: string | null;
  log_dir: string | null;
  slots: string[];
  lease: LeaseState | null;
  queued?: string[]; // engines waiting in a scheduler's queue: "slot 2: job 41 pending (Resources)"
  excluded?: Exclusion[]; // slots left out of engine starts
  resize: ResizeLife | null;
  state_mode?: 'replicated' | 'sharded'; // sharded (--shard): each rank holds its rows of the state
}

const BLANK: RunSnapshot = {
  id: null, name: '', notebook: null, state: 'starting', step: 0, total_steps: null, epoch: null,
  world_size: 0, requested_size: 0, min_size: null, max_size: null, backend: null, loss: null,
  recent_loss: [], samples_per_s: null, eta_s: null, error: null, checkpoint_dir: '', checkpoints: [],
  last_checkpoint: null, log_dir: null, slots: [], lease: null, queued: [], excluded: [], resize: null
};

/** "in the queue: slot 2: job 41 pending (Resources)", or '' when no engine waits. */
export function describeQueued(run: RunSnapshot): string {
  return run.queued?.length ? `in the queue: ${run.queued.join('; ')}` : '';
}

/** "slot 2 left out (3 faults within 60 s), back in 25 s" for each slot left out, or ''. */
export function describeExcluded(run: RunSnapshot, nowMs: number): string {
  return (run.excluded ?? []).map(x => `slot ${x.slot} left out (${x.reason}), ` + (x.until === null ? 'stays out' : `back in ${Math.max(0, Math.round(x.until - nowMs / 1000))} s`)).join('; ');
}

/**
 * A complete snapshot from what a server sent. Older Python sides send fewer fields (no
 * `resize`, and the widget's status no id, name or bounds): `known` fills those the view
 * knows otherwise, then blanks. Fields the server sent, null included, win.
 */
export function toSnapshot(raw: object, known: Partial<RunSnapshot> = {}): RunSnapshot {
  return { ...BLANK, ...defined(known), ...defined(raw as Partial<RunSnapshot>) };
}

function defined<T extends object>(fields: T): Partial<T> {
  return Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined)) as Partial<T>;
}

/** The slider's top: the pool's bound, and in lease mode what the arbiter can grant now. */
export function sliderMax(run: RunSnapshot): number {
  const max = run.max_size ?? run.world_size;
  return run.lease ? Math.max(Math.min(max, run.lease.grantable), run.world_size, 1) : max;
}

export function isActive(run: Pick<RunSnapshot, 'state'>): boolean {
  return ACTIVE_STATES.includes(run.state);
}

export function isEnded(run: Pick<RunSnapshot, 'state'>): boolean {
  return ENDED_STATES.includes(run.state);
}
