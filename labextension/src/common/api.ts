/**
 * Client of the server extension's REST API (elastic_jupyter/serverext.py), for the side panel
 * and the notebook dashboard alike. It knows the routes and answers, not how to reach the
 * server: the caller injects the request function (JupyterLab's ServerConnection in the
 * panel; a fetch with the page's token and XSRF cookie in the widget, whose bundle must stay
 * free of @jupyterlab packages).
 */
import { MachineView, RunSnapshot, toSnapshot } from './snapshot';

/** Sends a request to `path`, relative to the Jupyter server's base URL. */
export type Requester = (path: string, init: RequestInit) => Promise<Response>;

export interface HistoryPage {
  columns: string[];
  data: (number | null)[][];
  events: { kind: string; step: number; [key: string]: unknown }[];
  next: { since: number; events_since: number };
}

export class ApiError extends Error {
  /** `status` 0: no answer at all (network error, or no server page to ask). */
  constructor(public status: number, message: string) {
    super(message);
  }

  /**
   * The server cannot carry out this request, but the kernel's comm may: no server extension
   * or it cannot see the run (404), it or the run's control channel is broken (>= 500), or
   * there is no server to ask. Other errors (400 bounds, 409 ended) are the run's answer.
   */
  get fallback(): boolean {
    return this.status === 0 || this.status === 404 || this.status >= 500;
  }
}

const ROOT = 'elastic/api/runs';

export class RunsClient {
  constructor(private send: Requester) {}

  async runs(): Promise<RunSnapshot[]> {
    return (await this.request<{ runs: object[] }>(ROOT)).runs.map(r => toSnapshot(r));
  }

  async run(id: string): Promise<RunSnapshot> {
    return toSnapshot(await this.request<object>(path(id)));
  }

  /** 202: the run has the request; the returned snapshot shows it as requested_size. */
  async resize(id: string, worldSize: number): Promise<RunSnapshot> {
    return toSnapshot(await this.request<object>(path(id), { method: 'PATCH', body: JSON.stringify({ world_size: worldSize }) }));
  }

  /** Auto mode on or off: the machine's arbiter sizes the run (pools in lease mode only). */
  async setAuto(id: string, auto: boolean): Promise<RunSnapshot> {
    return toSnapshot(await this.request<object>(path(id), { method: 'PATCH', body: JSON.stringify({ auto }) }));
  }

  /** The machine's slots and runs, from its arbiter (`available` false when none answers). */
  machine(): Promise<MachineView> {
    return this.request('elastic/api/machine');
  }

  /** Stop after the current step (a checkpoint is written first). */
  async stop(id: string): Promise<RunSnapshot> {
    return toSnapshot(await this.request<object>(path(id), { method: 'DELETE' }));
  }

  /** Forget an ended run (204); 409 while it is active. Its checkpoints stay on disk. */
  async dismiss(id: string): Promise<void> {
    await this.request(path(id, 'dismiss'), { method: 'POST' });
  }

  history(id: string, since: number, eventsSince: number): Promise<HistoryPage> {
    return this.request(`${path(id, 'history')}?since=${since}&events_since=${eventsSince}`);
  }

  async logs(id: string): Promise<string> {
    return (await this.request<{ text: string }>(path(id, 'logs'))).text;
  }

  private async request<T>(url: string, init: RequestInit = {}): Promise<T> {
    let response: Response;
    try {
      response = await this.send(url, init);
    } catch (error) {
      if (error instanceof ApiError) {
        throw error; // the requester's own verdict, e.g. no server page to ask
      }
      throw new ApiError(0, `the Jupyter server does not answer: ${error instanceof Error ? error.message : error}`);
    }
    const body = response.status === 204 ? {} : await response.json().catch(() => ({}));
    if (!response.ok) {
      throw new ApiError(response.status, body.message || response.statusText || `HTTP ${response.status}`);
    }
    return body as T;
  }
}

function path(id: string, action = ''): string {
  return `${ROOT}/${encodeURIComponent(id)}${action ? '/' + action : ''}`;
}
