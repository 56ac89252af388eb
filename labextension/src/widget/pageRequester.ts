/**
 * How the notebook dashboard reaches the server extension without JupyterLab's services: the
 * page's `jupyter-config-data` (JupyterLab, Notebook 7) gives the base URL and token, the
 * `_xsrf` cookie the XSRF header. A page without it (VS Code) has no server to ask: requests
 * fail with status 0, and the dashboard falls back to its comm.
 */
import { ApiError, Requester } from '../common/api';

export interface PageConfig {
  baseUrl?: string;
  token?: string;
}

export function readPageConfig(): PageConfig | null {
  const node = document.getElementById('jupyter-config-data');
  try {
    return node ? (JSON.parse(node.textContent || '{}') as PageConfig) : null;
  } catch {
    return null;
  }
}

/** `cookie` is read at each request: the server may set `_xsrf` after the page loaded. */
export function pageRequester(config: PageConfig | null, cookie: () => string, fetchImpl: typeof fetch = fetch): Requester {
  return (path, init) => {
    if (!config?.baseUrl) {
      return Promise.reject(new ApiError(0, 'no Jupyter server page'));
    }
    const headers: Record<string, string> = { 'Content-Type': 'application/json' };
    if (config.token) {
      headers.Authorization = `token ${config.token}`;
    }
    const xsrf = cookie().match(/(?:^|;\s*)_xsrf=([^;]+)/);
    if (xsrf) {
      headers['X-XSRFToken'] = decodeURIComponent(xsrf[1]);
    }
    const base = config.baseUrl.endsWith('/') ? config.baseUrl : `${config.baseUrl}/`;
    return fetchImpl(base + path, { ...init, headers: { ...headers, ...(init.headers as Record<string, string>) }, credentials: 'same-origin' });
  };
}
