/**
 * The REST client both views share, against a fake server: routes, methods, answers, and which
 * errors send the dashboard to its comm; the widget's page requester; snapshots from older
 * Python sides.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { ApiError, RunsClient } from '../src/common/api';
import { toSnapshot } from '../src/common/snapshot';
import { pageRequester } from '../src/widget/pageRequester';

type Call = { path: string; init: RequestInit };

function fake(status: number, body?: object): { client: RunsClient; calls: Call[] } {
  const calls: Call[] = [];
  const client = new RunsClient(async (path, init) => {
    calls.push({ path, init });
    return new Response(body === undefined ? null : JSON.stringify(body), { status });
  });
  return { client, calls };
}

async function rejection(promise: Promise<unknown>): Promise<ApiError> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof ApiError);
    return error;
  }
  throw new Error('expected a rejection');
}

test('routes and methods of the REST API', async () => {
  const { client, calls } = fake(202, { id: 'a b', name: 'digits', state: 'training', world_size: 2, requested_size: 3 });
  const model = await client.resize('a b', 3);
  assert.equal(model.requested_size, 3);
  assert.equal(model.resize, null); // an older server: no resize life
  await client.stop('a b');
  await client.history('a b', 5, 2).catch(() => undefined);
  assert.deepEqual(calls.map(c => [c.init.method ?? 'GET', c.path]), [
    ['PATCH', 'elastic/api/runs/a%20b'],
    ['DELETE', 'elastic/api/runs/a%20b'],
    ['GET', 'elastic/api/runs/a%20b/history?since=5&events_since=2']
  ]);
  assert.deepEqual(JSON.parse(calls[0].init.body as string), { world_size: 3 });
});

test('the run list arrives as complete snapshots', async () => {
  const { client } = fake(200, { runs: [{ id: 'x', name: 'n', state: 'lost', world_size: 0, requested_size: 0, checkpoints: [] }] });
  const [r] = await client.runs();
  assert.equal(r.state, 'lost');
  assert.deepEqual([r.recent_loss, r.slots, r.resize, r.max_size], [[], [], null, null]);
});

test('dismiss posts to the run\'s dismiss route; 204 has no body; 409 shows the server\'s message', async () => {
  const ok = fake(204);
  await ok.client.dismiss('r-1');
  assert.deepEqual([ok.calls[0].init.method, ok.calls[0].path], ['POST', 'elastic/api/runs/r-1/dismiss']);
  const busy = fake(409, { message: 'run is training: stop it first' });
  const error = await rejection(busy.client.dismiss('r-1'));
  assert.equal(error.status, 409);
  assert.equal(error.message, 'run is training: stop it first');
  assert.equal(error.fallback, false);
});

test('404, 5xx and no answer fall back to the comm; refusals do not', async () => {
  assert.equal((await rejection(fake(404, { message: 'no run' }).client.stop('x'))).fallback, true);
  assert.equal((await rejection(fake(503, { message: 'unresponsive' }).client.stop('x'))).fallback, true);
  const refused = await rejection(fake(400, { message: 'outside this pool\'s bounds' }).client.resize('x', 9));
  assert.deepEqual([refused.fallback, refused.message], [false, 'outside this pool\'s bounds']);
  const down = new RunsClient(() => Promise.reject(new TypeError('Failed to fetch')));
  const error = await rejection(down.runs());
  assert.deepEqual([error.status, error.fallback], [0, true]);
  assert.match(error.message, /does not answer: Failed to fetch/);
});

test('the page requester sends token, XSRF cookie and same-origin credentials under the base URL', async () => {
  const seen: [string, RequestInit][] = [];
  const fetchImpl = (async (url: string, init: RequestInit) => {
    seen.push([url, init]);
    return new Response('{}', { status: 202 });
  }) as unknown as typeof fetch;
  const send = pageRequester({ baseUrl: '/user/alice', token: 'abc' }, () => 'a=1; _xsrf=2%7Cxyz; b=2', fetchImpl);
  await new RunsClient(send).resize('r-1', 2);
  const [url, init] = seen[0];
  assert.equal(url, '/user/alice/elastic/api/runs/r-1');
  assert.equal(init.method, 'PATCH');
  assert.equal(init.credentials, 'same-origin');
  assert.deepEqual(init.headers, { 'Content-Type': 'application/json', Authorization: 'token abc', 'X-XSRFToken': '2|xyz' });
});

test('a page without a Jupyter server sends nothing and falls back', async () => {
  const client = new RunsClient(pageRequester(null, () => '', (() => assert.fail('fetched')) as unknown as typeof fetch));
  const error = await rejection(client.resize('r-1', 2));
  assert.deepEqual([error.status, error.fallback, error.message], [0, true, 'no Jupyter server page']);
});

test('snapshots of older Python sides: missing fields from what the view knows, then blanks', () => {
  const status = { state: 'training', step: 5, total_steps: 10, world_size: 2, requested_size: 2, last_resize: { from: 1, to: 2, latency_s: 1, step: 3 } };
  const s = toSnapshot(status, { id: 'r-1', name: 'digits', min_size: 1, max_size: 4 });
  assert.deepEqual([s.id, s.name, s.min_size, s.max_size, s.resize, s.checkpoints], ['r-1', 'digits', 1, 4, null, []]);
  // what the server sends wins, null included
  assert.equal(toSnapshot({ max_size: null }, { max_size: 4 }).max_size, null);
});
