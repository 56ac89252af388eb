"""How the live loss chart copes with long runs: the real chart module (labextension/src/chart,
bundled with esbuild) in headless Chromium, drawing histories of 1k, 10k and 100k steps.

Per size it reports the first draw and the median / p95 time of a live update (5 new steps
appended as binary columns, smoothed series recomputed, redrawn), in one run so the sizes
compare side by side. Needs `make setup` (node_modules) and Debian's chromium.

    .venv/bin/python benchmarks/chart_render.py
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from lab_harness import chromium  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ENTRY = ("export { LossChart } from './labextension/src/chart/lossChart';"
         "export { History } from './labextension/src/chart/history';")

PAGE_SCRIPT = """
async ([n, updates]) => {
  const { LossChart, History } = window.EJChart;
  const names = ['step', 'epoch', 'loss', 'world_size', 'samples_per_s', 'time', 'val_loss'];
  const row = s => [s, Math.floor(s / 500), Math.exp(-s / (n / 3)) + 0.05 * Math.random(),
                    1 + (Math.floor(s / 5000) % 4), 20000, s * 0.01, s % 1000 === 0 ? 0.4 : null];
  const data = names.map(() => []);
  for (let s = 1; s <= n; s++) row(s).forEach((v, i) => data[i].push(v));
  const el = document.createElement('div');
  el.style.width = '1000px';
  document.body.replaceChildren(el);
  const history = new History();
  history.load(names, data);
  let t0 = performance.now();
  const chart = new LossChart(el, { smoothing: 0.6, log: false, metric: null });
  chart.setHistory(history);
  chart.setMarkers([{ kind: 'resized', step: Math.floor(n / 2) }, { kind: 'checkpoint', step: n }]);
  await Promise.resolve();
  const first = performance.now() - t0;
  const times = [];
  let step = n;
  for (let u = 0; u < updates; u++) {
    const views = names.map((_, i) => {
      const buf = new DataView(new ArrayBuffer(5 * 8));
      for (let k = 0; k < 5; k++) buf.setFloat64(8 * k, row(step + 1 + k)[i] ?? NaN, true);
      return buf;
    });
    step += 5;
    t0 = performance.now();
    history.appendBinary(names, views);
    chart.setHistory(history);
    await Promise.resolve(); // uPlot draws in a microtask
    times.push(performance.now() - t0);
    await new Promise(r => requestAnimationFrame(r));
  }
  times.sort((a, b) => a - b);
  chart.destroy();
  return { first, median: times[times.length >> 1], p95: times[Math.floor(times.length * 0.95)],
           points: Number(el.dataset.points) };
}
"""


def bundle() -> str:
    result = subprocess.run(
        ["npx", "esbuild", "--bundle", "--format=iife", "--global-name=EJChart",
         "--loader=ts", "--sourcefile=entry.ts", "--loader:.css=empty"],
        input=ENTRY, capture_output=True, text=True, cwd=ROOT, check=True)
    return result.stdout


def main() -> None:
    code = bundle()
    print(f"{'points':>8} {'first draw ms':>14} {'update median ms':>17} {'update p95 ms':>14} "
          f"{'ratio to 1k':>12}")
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        page.set_content("<html><body></body></html>")
        page.add_script_tag(content=code)
        base = None
        for n in (1_000, 10_000, 100_000):
            r = page.evaluate(PAGE_SCRIPT, [n, 60])
            base = base or r["median"]
            print(f"{n:>8} {r['first']:>14.1f} {r['median']:>17.2f} {r['p95']:>14.2f} "
                  f"{r['median'] / base:>12.1f}")
            assert r["points"] == n + 5 * 60


if __name__ == "__main__":
    main()
