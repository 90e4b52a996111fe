// The Timeline page (issue 21, #ck=timeline): a training run as a whole, from GET /api/history (ops/history.py,
// streamed with progress; the library caches each pair of checkpoints, so a second look reads no tensor). One
// column per checkpoint in the run's order, for every row: the step (a click opens it as B through the Run
// panel), markers (damaged, incomplete, abandoned, rolled back to, NaN/Inf, slow save), the tiers that hold it now
// (GET /api/run) and those its save went to, a chart of one metric, and the drift heatmap, a row per layer:
// ‖Δ‖/‖w‖ from the checkpoint before, in the viewer's colour maps as `tensormorph history -o` draws it. A click on
// a cell opens both checkpoints (POST /api/history/open) in the Diff view, on the layer's most-moved tensor.
// Everything from the run (names, metrics, problems) is text: el() and textContent, never markup.

import { ApiError, apiUrl, streamLines } from './api.js';
import { COLORMAPS, COLORMAP_LABELS, drawColorbar, makeNormaliser, rgbOf } from './colormaps.js';
import { bytes, el, int, midName, seconds, value as fmtValue } from './format.js';

const SLOW_FACTOR = 3;  // a save that held training up this many times the run's median is marked slow...
const SLOW_MIN_S = 0.5;  // ...and by this much at least: the jitter of fast saves is no news
const SAMPLE_BLOCKS = 8;  // blocks per tensor read for the quick estimate (`history --sample 8`)
const NO_FIGURE = 'rgb(232, 235, 240)';  // a cell without a figure: pictures.py NO_FIGURE_RGB
const LABEL_PX = 220;  // the label column of every row
const COL_MIN_PX = 22;  // narrower than this the markers collide: the page scrolls sideways instead
const COL_MAX_PX = 64;
const CHART_PX = 150;  // the height of the metric chart
const SVG = 'http://www.w3.org/2000/svg';
// what the chart may show, by id: "drift", "metric:NAME" (the caller's `extra`) or "save:FIELD" (the record of saves)
const DRIFT = 'drift';
const SAVES = [['blocked_s', 'save: training held up (s)'], ['durable_s', 'save: time to durable (s)']];
const MARKERS = {  // kind -> [glyph, meaning]
  damaged: ['✖', 'damaged'], incomplete: ['◌', 'incomplete: the save never committed'],
  abandoned: ['⊘', 'abandoned by a rollback (kept aside, never compared)'], rollback: ['⟲', 'rolled back to this step'],
  nonfinite: ['⚠', 'holds NaN or Inf'], slow: ['◔', 'slow save'],
};
const TIER_LETTERS = { memory: 'M', peer: 'P', disk: 'D', remote: 'R' };

function median(values) {
  const sorted = values.filter(Number.isFinite).sort((x, y) => x - y);
  return sorted.length ? sorted[Math.floor((sorted.length - 1) / 2)] : null;
}

/**
 * The page's model of a done line of /api/history and the run's listing: columns (the history's records, with
 * `held`: tiers of the listing that hold this very checkpoint, `markers`, `openable`), the layers in the model's
 * order, drift[layer][column] (null: no figure), and the metric names.
 */
export function timelineModel(done, listing) {
  const h = done.history;
  const rollback = done.rollback;
  const steps = new Map(((listing && listing.steps) || []).map((s) => [s.step, s]));
  const typical = median(h.checkpoints.map((r) => r.blocked_s));
  const first = new Map();
  for (const f of h.first_nonfinite) first.set(f.checkpoint, [...(first.get(f.checkpoint) || []), f.tensor]);
  const columns = h.checkpoints.map((r, index) => {
    const listed = r.status === 'abandoned' ? null : steps.get(r.step);
    const same = (info) => info && (info.seq === undefined || info.seq === null || r.seq === null || info.seq === r.seq);
    const held = listed ? listed.tiers.filter((t) => (t === 'disk' ? same(listed.disk) : t === 'remote' ? same(listed.remote) : true)) : [];
    const markers = [];
    if (MARKERS[r.status]) markers.push(r.status);
    if (rollback && r.step === rollback.step && r.seq === rollback.seq) markers.push('rollback');
    if (Object.keys(r.nonfinite).length) markers.push('nonfinite');
    if (typical !== null && r.blocked_s > SLOW_FACTOR * typical && r.blocked_s - typical > SLOW_MIN_S) markers.push('slow');
    const openable = r.status !== 'abandoned' && r.status !== 'incomplete' && Boolean(listed && (same(listed.disk) || same(listed.remote)));
    return { ...r, index, held, markers, openable, firstNonfinite: first.get(r.name) || [] };
  });
  const layers = [...new Set(h.checkpoints.flatMap((r) => (r.drift || []).map((d) => d.layer)))];
  const drift = layers.map((layer) => columns.map((c) => {
    const d = (c.drift || []).find((x) => x.layer === layer);
    return d && d.relative !== null ? d.relative : null;
  }));
  const metrics = [...new Set(h.checkpoints.flatMap((r) => Object.keys(r.metrics)))].sort();
  return { h, rollback, rollbackError: done.rollback_error, columns, layers, drift, metrics };
}

/** The name of the tensor of `layer` that moved most in a diff report (rel L2), or null. */
export function layerTensor(report, layer) {
  const inLayer = report.tensors.filter((t) => t.name.startsWith(`${layer}.`));
  inLayer.sort((x, y) => (y.rel_l2 ?? -1) - (x.rel_l2 ?? -1));
  return inLayer.length ? inLayer[0].name : null;
}

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, val] of Object.entries(attrs)) if (val !== null && val !== undefined) node.setAttribute(key, val);
  if (text !== null) node.textContent = text;
  return node;
}

function when(time) {
  return new Date(time * 1000).toLocaleString();
}

export class Timeline {
  /**
   * @param {HTMLElement} box the page's section
   * @param {{link: HTMLElement, listing: () => object, onStep: (step: number) => Promise<string|null>,
   *          onPair: (layer: string) => Promise<void>, onClose: () => void}} hooks
   */
  constructor(box, hooks) {
    Object.assign(this, { box, hooks });
    this.model = null;
    this.controller = null;  // the request in flight, aborted by Cancel
    this.settings = { metric: DRIFT, cmap: 'viridis', norm: 'linear', sample: '' };
    this.error = null;
    hooks.link.hidden = false;
  }

  /** Show the page for ck 'timeline' (true), else hide it (false). */
  route(ck) {
    const shown = ck === 'timeline';
    this.box.hidden = !shown;
    document.body.classList.toggle('timeline-mode', shown);
    this.hooks.link.classList.toggle('on', shown);
    if (shown && !this.model && !this.controller) this.load();
    return shown;
  }

  async load() {
    if (this.controller) this.controller.abort();
    const controller = new AbortController();
    this.controller = controller;
    this.error = null;
    this.box.dataset.state = 'loading';
    this.progress = { done: 0, total: null };
    this.render();
    try {
      const done = await streamLines('/api/history', { sample: this.settings.sample || null }, {
        signal: controller.signal,
        onLine: (line) => { if (line.progress) { this.progress = line.progress; this.renderProgress(); } },
      });
      this.model = timelineModel(done, this.hooks.listing());
      this.box.dataset.state = 'done';
    } catch (err) {
      const cancelled = controller.signal.aborted;
      this.error = cancelled ? 'Cancelled: nothing more is read. Pairs compared already are computed again next time.'
        : `Could not read the run's history: ${err.message}`;
      this.box.dataset.state = cancelled ? 'cancelled' : 'error';
    } finally {
      if (this.controller === controller) this.controller = null;
      this.render();
    }
  }

  cancel() {
    if (this.controller) this.controller.abort();
  }

  render() {
    const m = this.model;
    const sample = el('select', { 'data-testid': 'tl-sample', title: 'Exact reads every block of both checkpoints; an estimate samples a fixed set of blocks per tensor' },
      el('option', { value: '' }, 'exact'), el('option', { value: String(SAMPLE_BLOCKS) }, `estimate (${SAMPLE_BLOCKS} blocks/tensor)`));
    sample.value = this.settings.sample;
    sample.addEventListener('change', () => { this.settings.sample = sample.value; this.load(); });
    const busy = Boolean(this.controller);
    const head = el('div', { class: 'tl-head' },
      el('h2', {}, 'Timeline'), m ? el('span', { class: 'mono muted tl-run', title: m.h.run }, m.h.run) : null, sample,
      el('button', { type: 'button', 'data-testid': 'tl-refresh', disabled: busy, onclick: () => this.load(),
        title: 'Read the run again (pairs already compared come from the cache)' }, '↻ refresh'),
      busy ? el('button', { type: 'button', 'data-testid': 'tl-cancel', onclick: () => this.cancel() }, 'cancel') : null,
      el('button', { type: 'button', class: 'tl-close', title: 'Back to the checkpoints', onclick: () => this.hooks.onClose() }, '×'));
    this.progressEl = el('div', { class: 'tl-progress', 'data-testid': 'tl-progress', hidden: !busy });
    const parts = [head, this.progressEl];
    if (this.error) parts.push(el('div', { class: 'tl-note error-text', 'data-testid': 'tl-error' }, this.error));
    if (m) parts.push(this.summary(m), ...this.body(m));
    this.box.replaceChildren(...parts);
    this.renderProgress();
  }

  renderProgress() {
    if (!this.progressEl) return;
    const { done, total, waiting } = this.progress || {};
    const text = waiting ? 'Waiting for another computation of this run\'s history…'
      : total ? `Comparing checkpoints: ${int(done)} of ${int(total)}…` : 'Reading the run…';
    this.progressEl.replaceChildren(text, el('progress', { max: total || 1, value: total ? done : null }));
  }

  summary(m) {
    const notes = [
      `${int(m.columns.length)} checkpoint${m.columns.length === 1 ? '' : 's'}`,
      `${int(m.h.computed)} pair${m.h.computed === 1 ? '' : 's'} read, ${int(m.h.cache_hits)} from the cache`,
    ];
    const first = m.h.first_nonfinite[0];
    return el('div', { class: 'tl-summary', 'data-testid': 'tl-summary' }, notes.join(' · '),
      m.h.estimate ? el('span', { class: 'badge approx', 'data-testid': 'tl-estimate' }, `estimate: ${int(m.h.sample)} blocks per tensor`) : null,
      first ? el('span', { class: 'tl-warn', 'data-testid': 'tl-first-nonfinite' }, `first NaN/Inf: ${first.tensor} at step ${int(first.step)}`) : null,
      m.rollback ? el('span', { 'data-testid': 'tl-rollback' }, `rolled back to step ${int(m.rollback.step)}`) : null,
      m.h.cache_error ? el('span', { class: 'error-text' }, `cache not written: ${m.h.cache_error}`) : null,
      m.rollbackError ? el('span', { class: 'error-text' }, m.rollbackError) : null);
  }

  /** The width of a column, so that the chart and the table share one axis. */
  columnWidth(m) {
    const room = (this.box.clientWidth || 1200) - LABEL_PX - 40;
    return Math.max(COL_MIN_PX, Math.min(COL_MAX_PX, Math.floor(room / Math.max(1, m.columns.length))));
  }

  body(m) {
    const width = this.columnWidth(m);
    const choices = [[DRIFT, 'drift (all layers)'], ...m.metrics.map((k) => [`metric:${k}`, k]),
      ...SAVES.map(([k, text]) => [`save:${k}`, text])];
    if (!choices.some(([id]) => id === this.settings.metric)) this.settings.metric = DRIFT;
    this.metricLabel = choices.find(([id]) => id === this.settings.metric)[1];
    const pick = (key, options, label) => {
      const select = el('select', { 'data-testid': `tl-${key}`, 'aria-label': label },
        options.map(([v, text]) => el('option', { value: v }, text)));
      select.value = this.settings[key];
      select.addEventListener('change', () => { this.settings[key] = select.value; this.render(); });
      return el('label', {}, `${label} `, select);
    };
    const controls = el('div', { class: 'tl-controls' },
      pick('metric', choices, 'chart'),
      pick('cmap', Object.entries(COLORMAP_LABELS), 'colours'),
      pick('norm', [['linear', 'linear'], ['log', 'log']], 'scale'));
    const grid = el('div', { class: 'tl-grid', style: { width: `${LABEL_PX + width * m.columns.length}px` } },
      this.chart(m, width), this.table(m, width));
    return [controls, el('div', { class: 'tl-scroll' }, grid), this.legend(m)];
  }

  metricOf(column) {
    const id = this.settings.metric;
    if (id === DRIFT) return column.total_drift;
    const [kind, key] = [id.slice(0, id.indexOf(':')), id.slice(id.indexOf(':') + 1)];
    const source = kind === 'save' ? column : column.metrics;
    return Object.prototype.hasOwnProperty.call(source, key) ? source[key] : null;
  }

  chart(m, width) {
    const values = m.columns.map((c) => this.metricOf(c));
    const finite = values.filter((v) => v !== null && Number.isFinite(v));
    const lo = finite.length ? Math.min(...finite) : 0;
    const hi = finite.length ? Math.max(...finite) : 1;
    const pad = 12;
    const y = (v) => (hi > lo ? pad + (1 - (v - lo) / (hi - lo)) * (CHART_PX - 2 * pad) : CHART_PX / 2);
    const x = (j) => LABEL_PX + (j + 0.5) * width;
    const chart = svg('svg', { class: 'tl-chart', 'data-testid': 'tl-chart', width: LABEL_PX + width * m.columns.length, height: CHART_PX });
    for (const c of m.columns) {  // columns set apart: a band behind the chart
      if (c.status !== 'committed') chart.append(svg('rect', { class: `tl-band ${c.status}`, x: LABEL_PX + c.index * width, y: 0, width, height: CHART_PX }));
    }
    const label = this.metricLabel;
    chart.append(svg('text', { x: 4, y: 16, class: 'tl-axis-title' }, label),
      svg('text', { x: LABEL_PX - 6, y: pad + 4, class: 'tl-axis', 'text-anchor': 'end' }, fmtValue(hi, 4)),
      svg('text', { x: LABEL_PX - 6, y: CHART_PX - pad + 4, class: 'tl-axis', 'text-anchor': 'end' }, fmtValue(lo, 4)),
      svg('line', { x1: LABEL_PX, x2: LABEL_PX, y1: 0, y2: CHART_PX, class: 'tl-axis-line' }));
    const runs = [[]];  // a checkpoint without the figure breaks the line
    values.forEach((v, j) => {
      if (v !== null && Number.isFinite(v)) runs[runs.length - 1].push(`${x(j)},${y(v)}`);
      else if (runs[runs.length - 1].length) runs.push([]);
    });
    chart.append(svg('path', { d: runs.filter((r) => r.length).map((r) => `M${r.join('L')}`).join(' '), class: 'tl-line' }));
    if (m.rollback) {
      const target = m.columns.find((c) => c.markers.includes('rollback'));
      if (target) {
        chart.append(svg('line', { x1: x(target.index), x2: x(target.index), y1: 0, y2: CHART_PX, class: 'tl-rollback-line' }),
          svg('text', { x: x(target.index) + 4, y: CHART_PX - 4, class: 'tl-axis' }, `⟲ rolled back to ${target.step}`));
      }
    }
    values.forEach((v, j) => {
      if (v === null || !Number.isFinite(v)) return;
      const dot = svg('circle', { cx: x(j), cy: y(v), r: 3.5, class: 'tl-point', 'data-testid': 'tl-point',
        'data-col': j, 'data-step': m.columns[j].step, 'data-value': String(v) });
      dot.append(svg('title', {}, `step ${m.columns[j].step}: ${label} ${fmtValue(v, 6)}`));
      chart.append(dot);
    });
    return chart;
  }

  table(m, width) {
    const colgroup = el('colgroup', {}, el('col', { style: { width: `${LABEL_PX}px` } }),
      m.columns.map(() => el('col', { style: { width: `${width}px` } })));
    const row = (label, cells, attrs = {}) => el('tr', attrs, el('th', { scope: 'row' }, label), cells);
    const steps = row('step', m.columns.map((c) => el('td', {}, this.stepButton(c))));
    const start = Math.min(...m.columns.map((c) => c.time));
    const saved = row('saved', m.columns.map((c) => el('td', { class: 'tl-time', 'data-testid': 'tl-time', title: when(c.time) },
      c.time === start ? '0' : `+${seconds(c.time - start)}`)));
    const markers = row('markers', m.columns.map((c) => el('td', { class: 'tl-markers' },
      c.markers.map((kind) => el('span', { class: `tl-marker ${kind}`, 'data-testid': 'tl-marker', 'data-kind': kind,
        'data-col': c.index, title: this.markerTitle(c, kind) }, MARKERS[kind][0])))));
    const tiers = row('tiers now', m.columns.map((c) => el('td', {
      class: 'tl-tiers', 'data-testid': 'tl-tiers', 'data-col': c.index, 'data-tiers': c.held.join(' '),
      title: `now: ${c.held.join(', ') || 'in no tier of the listing'}\nsaved to: ${(c.tiers || []).join(', ') || 'unknown'}`,
    }, c.held.map((t) => el('span', { class: `tier tier-${t}` }, TIER_LETTERS[t] || t)))));
    const lut = COLORMAPS[this.settings.cmap];
    const all = Float64Array.from(m.drift.flat().filter((v) => v !== null));
    const normaliser = makeNormaliser(all, this.settings.norm);
    this.normaliser = normaliser;
    const layers = m.layers.map((layer, i) => row(midName(layer, 'mono'), m.columns.map((c, j) => this.cell(m, layer, i, c, j, lut, normaliser)),
      { class: 'tl-layer', 'data-layer': layer }));
    const head = el('tr', { class: 'tl-section' }, el('th', { scope: 'row' }, 'drift ‖Δ‖/‖w‖ per layer'), el('td', { colspan: m.columns.length }));
    return el('table', { class: 'tl-table', 'data-testid': 'tl-table', style: { width: `${LABEL_PX + width * m.columns.length}px` } },
      colgroup, el('tbody', {}, steps, saved, markers, tiers, head, layers));
  }

  stepButton(c) {
    const tip = [`${c.name}${c.step === null ? '' : ` · step ${int(c.step)}`}`, `${c.status} · ${bytes(c.size)} · ${when(c.time)}`];
    if (c.problem) tip.push(c.problem);
    if (c.blocked_s !== null) tip.push(`training held up ${seconds(c.blocked_s)}, durable after ${seconds(c.durable_s)}`);
    for (const [key, v] of Object.entries(c.metrics)) tip.push(`${key}: ${fmtValue(v, 6)}`);
    tip.push(c.openable ? 'Click to open it as B' : 'Not openable: it is not a checkpoint of the run\'s listing on disk or in the object store');
    return el('button', {
      type: 'button', class: `tl-step ${c.status}`, 'data-testid': 'tl-step', 'data-col': c.index,
      'data-step': c.step === null ? '' : c.step, 'data-status': c.status, disabled: !c.openable, title: tip.join('\n'),
      onclick: () => this.openStep(c),
    }, c.step === null ? '–' : String(c.step));
  }

  markerTitle(c, kind) {
    if (kind === 'damaged' || kind === 'incomplete') return `${MARKERS[kind][1]}: ${c.problem || ''}`;
    if (kind === 'nonfinite') {
      const counts = Object.entries(c.nonfinite).map(([t, [nans, infs]]) => `${t}: ${int(nans)} NaN, ${int(infs)} Inf`);
      const first = c.firstNonfinite.length ? [`first appearance of ${c.firstNonfinite.join(', ')}`] : [];
      return [MARKERS[kind][1], ...first, ...counts].join('\n');
    }
    if (kind === 'slow') return `${MARKERS[kind][1]}: training held up ${seconds(c.blocked_s)}`;
    return MARKERS[kind][1];
  }

  cell(m, layer, i, c, j, lut, normaliser) {
    const v = m.drift[i][j];
    const d = (c.drift || []).find((x) => x.layer === layer);
    const attrs = { class: 'tl-cell', 'data-testid': 'tl-cell', 'data-layer': layer, 'data-col': j,
      'data-value': v === null ? '' : String(v) };
    if (v === null) {
      const why = !c.drift ? (c.status === 'committed' ? 'the first checkpoint compared' : c.status)
        : d ? 'the earlier weights are all zero (or not finite)' : 'not in this checkpoint';
      return el('td', { ...attrs, style: { background: NO_FIGURE }, title: `${layer} · step ${c.step}: no figure (${why})` });
    }
    const [r, g, b] = rgbOf(normaliser.map(v), lut);
    return el('td', {
      ...attrs, class: 'tl-cell figure', style: { background: `rgb(${r}, ${g}, ${b})` },
      title: `${layer}\nstep ${c.previous} → ${c.name}: ‖Δ‖/‖w‖ = ${fmtValue(v, 6)} over ${int(d.tensors)} tensor(s)\nClick: the Diff view of this layer`,
      onclick: () => this.openPair(m, layer, c),
    });
  }

  legend(m) {
    const bar = el('canvas', { class: 'tl-colorbar' });
    drawColorbar(bar, COLORMAPS[this.settings.cmap]);
    const n = this.normaliser;
    const tiers = Object.entries(TIER_LETTERS).map(([t, letter]) => `${letter} ${t}`).join(' · ');
    const marks = Object.values(MARKERS).map(([glyph, text]) => `${glyph} ${text}`).join(' · ');
    return el('div', { class: 'tl-legend' },
      m.layers.length ? el('span', {}, el('span', { 'data-testid': 'tl-legend-lo' }, fmtValue(n.lo, 4)), bar,
        el('span', { 'data-testid': 'tl-legend-hi' }, fmtValue(n.hi, 4))) : el('span', { class: 'muted' }, 'No drift yet: it needs two readable checkpoints in a row.'),
      el('span', { class: 'muted' }, `tiers: ${tiers}`), el('span', { class: 'muted' }, marks));
  }

  async openStep(c) {
    const why = await this.hooks.onStep(c.step);
    if (why) this.fail(why);
  }

  async openPair(m, layer, c) {
    const before = m.columns.find((x) => x.name === c.previous);
    try {
      const url = apiUrl('/api/history/open', { a: c.step, b: before.step });
      const response = await fetch(url, { method: 'POST' });
      const body = await response.json().catch(() => ({ error: `${response.status} ${response.statusText}` }));
      if (!response.ok) throw new ApiError(response.status, body, url);
      await this.hooks.onPair(layer);
    } catch (err) {
      this.fail(`Could not open steps ${c.step} and ${before.step}: ${err.message}`);
    }
  }

  fail(message) {
    this.error = message;
    this.render();
  }
}
