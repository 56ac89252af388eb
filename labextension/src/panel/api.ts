/**
 * Client of the server extension's REST API (elastic_jupyter/serverext.py). Requests go through
 * JupyterLab's ServerConnection, which adds the token / XSRF header and the base URL.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { HistoryPage, RunModel } from './model';

export class ApiError extends Error {
  constructor(public status: number, message: string) {
    super(message);
  }
}

export class ElasticApi {
  private settings = ServerConnection.makeSettings();

  async runs(): Promise<RunModel[]> {
    return (await this.request<{ runs: RunModel[] }>('')).runs;
  }

  resize(id: string, worldSize: number): Promise<RunModel> {
    return this.request(encodeURIComponent(id), { method: 'PATCH', body: JSON.stringify({ world_size: worldSize }) });
  }

  stop(id: string): Promise<RunModel> {
    return this.request(encodeURIComponent(id), { method: 'DELETE' });
  }

  history(id: string, since: number, eventsSince: number): Promise<HistoryPage> {
    return this.request(`${encodeURIComponent(id)}/history?since=${since}&events_since=${eventsSince}`);
  }

  async logs(id: string): Promise<string> {
    return (await this.request<{ text: string }>(`${encodeURIComponent(id)}/logs`)).text;
  }

  private async request<T>(path: string, init: RequestInit = {}): Promise<T> {
    const url = URLExt.join(this.settings.baseUrl, 'elastic/api/runs', path);
    let response: Response;
    try {
      response = await ServerConnection.makeRequest(url, init, this.settings);
    } catch (error) {
      throw new ApiError(0, `the Jupyter server does not answer: ${error}`);
    }
    const body = await response.json().catch(() => ({}));
    if (!response.ok) {
      throw new ApiError(response.status, body.message || response.statusText);
    }
    return body as T;
  }
}
