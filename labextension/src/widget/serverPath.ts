/**
 * The dashboard's route to the server extension's REST API, so a resize or stop never waits
 * for the kernel's shell. Works where the page is served by a Jupyter server that has the
 * extension (JupyterLab, Notebook 7); elsewhere (VS Code) the dashboard falls back to its comm.
 */
export type Outcome = { ok: true } | { ok: false; fallback: boolean; message: string };

interface PageConfig {
  baseUrl?: string;
  token?: string;
}

function pageConfig(): PageConfig | null {
  const node = document.getElementById('jupyter-config-data');
  try {
    return node ? (JSON.parse(node.textContent || '{}') as PageConfig) : null;
  } catch {
    return null;
  }
}

/** PATCH (resize) or DELETE (stop) a run; `fallback` says to use the comm instead. */
export async function requestRun(runId: string | null, method: 'PATCH' | 'DELETE', body?: object): Promise<Outcome> {
  const config = pageConfig();
  if (!config?.baseUrl || !runId) {
    return { ok: false, fallback: true, message: 'no Jupyter server page' };
  }
  const headers: Record<string, string> = { 'Content-Type': 'application/json' };
  if (config.token) {
    headers.Authorization = `token ${config.token}`;
  }
  const xsrf = document.cookie.match(/(?:^|;\s*)_xsrf=([^;]+)/);
  if (xsrf) {
    headers['X-XSRFToken'] = decodeURIComponent(xsrf[1]);
  }
  const base = config.baseUrl.endsWith('/') ? config.baseUrl : `${config.baseUrl}/`;
  try {
    const response = await fetch(`${base}elastic/api/runs/${encodeURIComponent(runId)}`, {
      method, headers, credentials: 'same-origin', body: body ? JSON.stringify(body) : undefined
    });
    if (response.ok) {
      return { ok: true };
    }
    const reply = await response.json().catch(() => ({}));
    // 404: no extension on this server, or it cannot see the run: the comm can still reach it
    return { ok: false, fallback: response.status === 404 || response.status >= 500, message: reply.message || response.statusText };
  } catch (error) {
    return { ok: false, fallback: true, message: String(error) };
  }
}
