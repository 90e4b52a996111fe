// Tensormorph viewer: routing, state and wiring of the views. Plain ES modules, no build step,
// nothing fetched but the API of the server that serves this page.
//
// The URL hash holds what is on screen (route.js: checkpoint, tensor, rank, axes, zoom, pan, colours,
// block summary, diff kind, pin), so a view can be bookmarked or shared. Opening a tensor, a rank or a
// checkpoint adds a history entry; zooming, panning and colours update the current one, so Back and
// Forward step through what the user opened. The query string is left to the server (?token=...).

import { ApiError, forgetEarly, getJSON } from './api.js';
import { DiffView, statusLabel } from './diff.js';
import { Finder } from './find.js';
import { bytes, el, int, midName, shape as fmtShape } from './format.js';
import { renderCheckpointInfo, renderConfig, renderTabs } from './header.js';
import { Heatmap } from './heatmap.js';
import { Inspector } from './inspector.js';
import { Panes } from './layout.js';
import { formatRoute, parseRoute, planPage, showCommand } from './route.js';
import { RunPanel } from './run.js';
import { copyText } from './share.js';
import { diffSource, localShape, tensorSource } from './sources.js';
import { Timeline, layerTensor } from './timeline.js';
import { TreeView, largestTensors } from './tree.js';

const $ = (id) => document.getElementById(id);

const ROUTE_DELAY_MS = 250;  // zooms, pans and colour changes settle into one update of the URL

/** Everything on screen, readable by tests through window.tensormorph.state. */
const state = {
  checkpoints: [],
  active: null,  // 'a', 'b' or 'diff'
  summaries: {},
  selection: null,  // {ck, name}
  record: null,  // the /tensor answer of the selection
  rank: null,  // null: full(); a number: local(rank)
  diff: null,  // the /api/diff report once loaded
  diffSelection: null,  // a TensorDiff record
  kind: 'diff',
  error: null,
};

let resolveReady;
const ready = new Promise((resolve) => { resolveReady = resolve; });

let heatmap;
let tree;
let inspector;
let diffView = null;
let finder;
let panes;
let runPanel;
let timeline = null;  // the run's Timeline page (#ck=timeline), when the viewer serves a run
let tensorRequest = 0;
const savedSettings = { tensor: null, diff: null };

// ---------------------------------------------------------------- routing

let restoring = false;  // a route is being applied: it adds no history entry
let routeTimer = 0;
let writtenHash = null;  // the hash this page wrote last, so its own change is not applied again

function currentRoute() {
  const route = { ck: state.active };
  if (state.active === 'diff') {
    route.kind = state.kind;
    if (state.diffSelection) route.t = state.diffSelection.name;
  } else if (state.selection) {
    route.t = state.selection.name;
    route.rank = state.rank;
  }
  if (route.t && heatmap.source) {
    route.view = heatmap.viewState();
    route.settings = heatmap.settings;
  }
  return route;
}

/** Put the view in the URL: a new history entry with push (a tensor, rank or checkpoint opened). */
function writeRoute({ push = false } = {}) {
  clearTimeout(routeTimer);
  routeTimer = 0;
  const hash = formatRoute(currentRoute());
  writtenHash = hash;
  updateShareTitles();
  if (hash === location.hash) return;
  const url = `${location.pathname}${location.search}${hash}`;
  if (push && !restoring) history.pushState(null, '', url);
  else history.replaceState(null, '', url);
}

function scheduleRoute() {
  if (restoring || !heatmap) return;
  clearTimeout(routeTimer);
  routeTimer = setTimeout(() => writeRoute(), ROUTE_DELAY_MS);
  updateShareTitles();  // the pin may have come or gone
}

/** Before the user opens something else: the current entry keeps the view as it is now. */
function leaveEntry() {
  if (!restoring && routeTimer) writeRoute();
}

/** Show what the URL says (at start, Back/Forward, an edited or followed link). */
async function applyRoute() {
  const route = parseRoute(location.hash);
  if ((timeline && timeline.route(route.ck)) || location.hash === writtenHash) return;
  const ids = state.checkpoints.map((c) => c.id);
  const first = state.checkpoints.find((c) => !c.config_only).id;
  const ck = route.ck === 'diff' && ids.length > 1 ? 'diff' : ids.includes(route.ck) ? route.ck : first;
  restoring = true;
  try {
    if (route.kind) state.kind = route.kind;
    $('diff-kind').value = state.kind;
    if (ck !== state.active) await activate(ck);
    if (Object.keys(route.settings).length) heatmap.set(route.settings);
    if (ck === 'diff') {
      const shown = heatmap.source && state.diffSelection;
      if (!route.t) {
        if (state.diffSelection) await activate('diff');
      } else if (!shown || state.diffSelection.name !== route.t || heatmap.source.params.kind !== state.kind) {
        const rec = diffView.select(route.t);
        if (rec) showDiffTensor(rec, { view: route.view });
      } else {
        await heatmap.restoreView(route.view);
      }
    } else if (!route.t) {
      if (state.selection) await activate(ck);
    } else if (!state.selection || state.selection.name !== route.t || state.rank !== route.rank || !heatmap.source) {
      await selectTensor(route.t, { rank: route.rank, view: route.view });
    } else {
      await heatmap.restoreView(route.view);
    }
  } finally {
    restoring = false;
  }
  writeRoute();
}

// ---------------------------------------------------------------- sharing

/** The `tensormorph show` command(s) of the pinned element, else of the visible region. */
function showCommandText({ pinned = Boolean(heatmap.pin) } = {}) {
  const index = pinned ? heatmap.pin : heatmap.regionIndex();
  if (!index) return null;
  const path = (id) => state.checkpoints.find((c) => c.id === id).path;
  if (state.active === 'diff') {
    const rec = state.diffSelection;
    return rec ? `${showCommand(path('a'), rec.name_a, index)}\n${showCommand(path('b'), rec.name_b, index)}` : null;
  }
  return state.record ? showCommand(path(state.selection.ck), state.record.name, index, state.rank) : null;
}

function copyShow(options) {
  const text = showCommandText(options);
  if (text) copyText($('toast'), text, 'command');
}

function copyLink() {
  writeRoute();
  copyText($('toast'), location.href, 'link');
}

function updateShareTitles() {
  const shown = Boolean(heatmap && heatmap.source);
  $('copy-show').disabled = !shown;
  $('copy-show').title = heatmap && heatmap.pin ? 'Copy the tensormorph show command of the pinned element'
    : 'Copy the tensormorph show command of the visible region';
}

// ---------------------------------------------------------------- modes

async function loadSummary(id) {
  if (!state.summaries[id]) state.summaries[id] = await getJSON(`/api/checkpoints/${id}/summary`);
  return state.summaries[id];
}

async function activate(ck) {
  const entry = state.checkpoints.find((c) => c.id === ck);
  if (entry && entry.config_only) {
    location.assign(planPage(ck, location.search));
    return;
  }
  if (timeline) timeline.route(ck);
  const wasDiff = state.active === 'diff';
  state.active = ck;
  renderTabs($('tabs'), state.checkpoints, ck, go);
  const diffMode = ck === 'diff';
  document.body.classList.toggle('diff-mode', diffMode);
  $('arch-pane').hidden = diffMode;
  $('diff-pane').hidden = !diffMode;
  $('kind-wrap').hidden = !diffMode;
  if (diffMode !== wasDiff) {
    // Diff and tensor views want different default colours: keep each mode's own settings.
    savedSettings[wasDiff ? 'diff' : 'tensor'] = { ...heatmap.settings };
    const next = savedSettings[diffMode ? 'diff' : 'tensor'];
    if (next) heatmap.set(next);
    else if (diffMode) heatmap.set(kindSettings(state.kind));
  }
  state.selection = null;
  state.record = null;
  state.diffSelection = null;
  finder.setTarget(null);
  await heatmap.setSource(null);
  if (diffMode) {
    renderCheckpointInfo($('ckinfo'), state);
    setTitle('Select a tensor in the diff table');
    inspector.message('Pick a row of the diff table to see a − b.');
    if (!diffView) diffView = new DiffView($('diff-pane'), { onSelect: (rec) => showDiffTensor(rec) });
    if (!state.diff) state.diff = await diffView.load();
    welcome();
  } else {
    const summary = await loadSummary(ck);
    renderCheckpointInfo($('ckinfo'), { ...state, summary });
    renderConfig($('config'), summary);
    tree.setSummary(summary);
    inspector.showCheckpoint(ck, summary);
    setTitle('No tensor selected');
    welcome();
  }
  writeRoute({ push: true });
}

function go(ck) {
  leaveEntry();
  activate(ck).catch(fail);
}

/** The diff view's colours: a − b on a diverging map (signed, block mean), |a − b| on magma (abs-max). */
function kindSettings(kind) {
  return kind === 'absdiff' ? { cmap: 'magma', norm: 'linear', agg: 'auto' } : { cmap: 'diverging', norm: 'symmetric', agg: 'auto' };
}

/** The canvas's empty state: the largest tensors, one click away. */
function welcome() {
  const box = $('canvas-message');
  box.classList.remove('error');
  if (state.active === 'diff') {
    const changed = state.diff ? state.diff.tensors.filter((t) => t.status !== 'equal').slice(0, 8) : [];
    box.replaceChildren(el('div', { class: 'welcome' }, el('h3', {}, changed.length ? 'Largest differences' : 'No differences'),
      ...changed.map((t) => el('button', { type: 'button', onclick: () => { const rec = diffView.select(t.name); if (rec) showDiffTensor(rec); } },
        midName(t.name), el('span', { class: 'muted' }, statusLabel(t.status))))));
    return;
  }
  const summary = state.summaries[state.active];
  if (!summary) return;
  const largest = largestTensors(summary.tensors, 8);
  box.replaceChildren(el('div', { class: 'welcome' }, el('h3', {}, 'Pick a tensor on the left, or one of the largest:'),
    ...largest.map((t) => el('button', { type: 'button', onclick: () => selectTensor(t.name) },
      midName(t.name), el('span', { class: 'muted' }, `${fmtShape(t.shape)} · ${bytes(t.nbytes)}`)))));
}

function setTitle(text, detail = '', { name = false } = {}) {
  const title = $('view-title');
  title.replaceChildren(name ? midName(text, 'mono') : el('span', { class: 'plain' }, text));
  title.title = detail ? `${text}\n${detail}` : text;
  if (detail) title.append(el('small', {}, detail));
}

// ---------------------------------------------------------------- tensor selection

async function selectTensor(name, { rank = null, view = null } = {}) {
  if (state.active === 'diff' || !state.active) return;
  leaveEntry();
  const ck = state.active;
  const seq = ++tensorRequest;
  state.selection = { ck, name };
  tree.reveal(name);
  $('canvas-message').replaceChildren();
  setTitle(name, 'loading…', { name: true });
  let record;
  try {
    record = await getJSON(`/api/checkpoints/${ck}/tensor`, { name });
  } catch (err) {
    if (seq !== tensorRequest) return;
    setTitle(name, '', { name: true });
    state.record = null;
    await heatmap.setSource(null);  // not the previous tensor's image under the error
    heatmap.setMessage(`Could not open the tensor: ${err.message}`, { error: true });
    writeRoute({ push: true });
    return;
  }
  if (seq !== tensorRequest) return;
  state.record = record;
  state.rank = rank !== null && (record.ranks || []).includes(rank) ? rank : null;
  const shown = showRecord({ view });
  writeRoute({ push: true });
  await shown;
}

/** Show the selected record in the inspector and the heatmap; resolves once the heatmap has its view. */
function showRecord({ view = null } = {}) {
  const { record, rank } = state;
  const ck = state.selection.ck;
  setTitle(record.name, `${record.dtype} · ${fmtShape(record.shape)} · ${rank === null ? 'full()' : `local(${rank})`}`, { name: true });
  heatmap.setRange(null);
  inspector.showTensor(ck, record, rank);
  const empty = record.shape.includes(0) || (rank !== null && localShape(record, rank).includes(0));
  finder.setTarget(empty ? null : { endpoint: `/api/checkpoints/${ck}/search`, params: { name: record.name, rank }, diff: false });
  if (record.shape.includes(0)) {
    heatmap.setSource(null);
    heatmap.setMessage('empty tensor: no elements to draw');
    return Promise.resolve();
  }
  if (rank !== null && localShape(record, rank).includes(0)) {
    heatmap.setSource(null);
    heatmap.setMessage(`rank ${rank} holds 0 of ${int(record.numel)} elements`);
    return Promise.resolve();
  }
  return heatmap.setSource(tensorSource(ck, record, rank), { view });
}

function setRank(rank) {
  if (!state.record) return;
  leaveEntry();
  state.rank = rank;
  showRecord();
  writeRoute({ push: true });
}

/** The statistics of the tensor in view arrived: the scale may lock to their range. */
function statsArrived(stats, { ck, name, rank }) {
  const sel = state.selection;
  if (!sel || sel.ck !== ck || sel.name !== name || state.rank !== rank) return;
  const known = Number.isFinite(stats.min) && Number.isFinite(stats.max);
  heatmap.setRange(known ? { min: stats.min, max: stats.max, absMax: stats.abs_max } : null);
  finder.setCounts(stats);
}

function showDiffTensor(rec, { view = null } = {}) {
  leaveEntry();
  state.diffSelection = rec;
  inspector.showDiff(rec);
  const elementwise = rec.shape_a && rec.shape_b && JSON.stringify(rec.shape_a) === JSON.stringify(rec.shape_b);
  setTitle(rec.name, `${statusLabel(rec.status)} · ${state.kind === 'diff' ? 'a − b' : '|a − b|'}`, { name: true });
  finder.setTarget(elementwise ? { endpoint: '/api/diff/search', params: { name: rec.name }, diff: true } : null);
  if (!elementwise) {
    heatmap.setSource(null);
    const why = rec.status === 'only_a' ? 'only in A' : rec.status === 'only_b' ? 'only in B' : 'shapes differ';
    heatmap.setMessage(`No element-wise difference to draw: ${why}.`);
    writeRoute({ push: true });
    return;
  }
  const m = rec.max_abs;
  const known = m !== null && m !== undefined && Number.isFinite(m);
  heatmap.setSource(diffSource(rec, state.kind), { view });
  heatmap.setRange(known ? { min: state.kind === 'diff' ? -m : 0, max: m, absMax: m } : null);
  writeRoute({ push: true });
}

// ---------------------------------------------------------------- training run

/** Steps of the run were opened (run.js, timeline.js) as A and/or B: show `id`, on the tensor in view when it has one
 * too, or with `layer` the Diff view of the layer's most-moved tensor. */
async function stepOpened({ id, layer = null }) {
  leaveEntry();
  const keep = state.active !== 'diff' && state.selection
    ? { name: state.selection.name, rank: state.rank, view: heatmap.source ? heatmap.viewState() : null } : null;
  const before = Object.fromEntries(state.checkpoints.map((c) => [c.id, c.path]));
  state.checkpoints = await getJSON('/api/checkpoints');
  for (const c of state.checkpoints.filter((c) => c.path !== before[c.id])) {  // another step now: forget the old
    delete state.summaries[c.id];
    state.diff = null;
  }
  runPanel.setServed(state.checkpoints);
  await activate(id);
  const rec = layer && state.diff ? diffView.select(layerTensor(state.diff, layer)) : null;
  if (rec) showDiffTensor(rec);
  else if (keep && id !== 'diff' && state.summaries[id].tensors.some((t) => t.name === keep.name)) await selectTensor(keep.name, keep);
}

// ---------------------------------------------------------------- keyboard

function onKey(e) {
  const target = e.target;
  const typing = target.closest && target.closest('input, select, textarea');
  if (e.key === 'Escape') {
    $('help').hidden = true;
    $('toast').hidden = true;
    if (heatmap.pin && !typing) heatmap.unpin();
    if (target === $('search')) {
      tree.setQuery('');
      target.blur();
    }
    return;
  }
  if (typing || e.ctrlKey || e.metaKey || e.altKey) return;
  const pan = Math.max(40, Math.min(heatmap.canvas.width, heatmap.canvas.height) * 0.15);
  switch (e.key) {
    case '/': $('search').focus(); $('search').select(); break;
    case '?': $('help').hidden = !$('help').hidden; break;
    case '+': case '=': heatmap.zoomBy(2); break;
    case '-': case '_': heatmap.zoomBy(0.5); break;
    case '0': case 'f': heatmap.fit(); break;
    case '1': heatmap.zoomOneToOne(); break;
    case 'c': heatmap.cycle('cmap', ['viridis', 'magma', 'diverging', 'grey', 'cividis']); break;
    case 'n': heatmap.cycle('norm', ['linear', 'symmetric', 'log', 'clip']); break;
    case '[': panes.toggle('left'); break;
    case ']': panes.toggle('right'); break;
    case 'ArrowLeft': heatmap.panBy(pan, 0); break;
    case 'ArrowRight': heatmap.panBy(-pan, 0); break;
    case 'ArrowUp': heatmap.panBy(0, pan); break;
    case 'ArrowDown': heatmap.panBy(0, -pan); break;
    default: return;
  }
  e.preventDefault();
}

// ---------------------------------------------------------------- boot

function fail(err) {
  state.error = err.message;
  document.body.dataset.error = err.message;
  const box = $('canvas-message');
  box.classList.add('error');
  box.textContent = err instanceof ApiError && (err.status === 401 || err.status === 403)
    ? 'The server wants a token: open the URL it printed (…?token=…).'
    : `Error: ${err.message}`;
  console.error(err);
}

async function boot() {
  heatmap = new Heatmap({
    canvas: $('heatmap'), wrap: $('canvas-wrap'),
    zoomInButton: $('zoom-in'), zoomOutButton: $('zoom-out'), zoomFitButton: $('zoom-fit'),
    zoomLevelEl: $('zoom-level'), zoomMagEl: $('zoom-mag'), badge: $('approximate-badge'),
    messageEl: $('canvas-message'), hoverEl: $('hover-value'),
    legendLo: $('legend-lo'), legendHi: $('legend-hi'), colorbar: $('colorbar'),
    axesBox: $('axes-controls'), aggSelect: $('agg'), cmapSelect: $('cmap'), normSelect: $('norm'),
    clipInput: $('clip'), clipWrap: $('clip-wrap'), lockInput: $('lock'), lockWrap: $('lock-wrap'),
    rulerTop: $('ruler-top'), rulerLeft: $('ruler-left'), pinEl: $('pin-card'),
    onHover: (info) => inspector.highlight(info),
    onViewChange: () => scheduleRoute(),
    onCopyPin: () => copyShow({ pinned: true }),
  });
  inspector = new Inspector($('inspector'), {
    onRank: (rank) => setRank(rank),
    onFocusIndex: (index) => heatmap.focusIndex(index),
    onChunk: (chunk) => (state.rank === null ? heatmap.focusBox(chunk.offsets, chunk.shape) : chunk.ranks.length && setRank(chunk.ranks[0])),
    onStats: (stats, view) => statsArrived(stats, view),
  });
  panes = new Panes({ toggleLeft: $('toggle-left'), toggleRight: $('toggle-right') });
  finder = new Finder($('find-controls'), {
    viewParams: () => { const { axes } = heatmap.slice.params(); return axes ? { axes } : {}; },
    onFound: (result) => heatmap.showFound(result),
  });
  $('copy-link').addEventListener('click', copyLink);
  $('copy-show').addEventListener('click', () => copyShow());
  tree = new TreeView({
    list: $('tree-list'), status: $('list-status'), search: $('search'), modeToggle: $('mode-toggle'),
    onSelect: (name) => selectTensor(name),
  });
  $('diff-kind').addEventListener('change', () => {
    state.kind = $('diff-kind').value;
    heatmap.set(kindSettings(state.kind));
    if (state.diffSelection) showDiffTensor(state.diffSelection);
    else writeRoute();
  });
  $('plan-link').href = `plan.html${location.search}`;  // the token travels with it
  $('help-button').addEventListener('click', () => { $('help').hidden = !$('help').hidden; });
  $('help').addEventListener('click', (e) => { if (e.target === $('help')) $('help').hidden = true; });
  document.addEventListener('keydown', onKey);
  // Back/Forward (popstate) and an edited hash (hashchange too): whichever comes first applies it.
  window.addEventListener('popstate', () => applyRoute().catch(fail));
  window.addEventListener('hashchange', () => applyRoute().catch(fail));

  state.checkpoints = await getJSON('/api/checkpoints');
  if (!state.checkpoints.length) throw new Error('the server lists no checkpoints');
  if (state.checkpoints.every((c) => c.config_only)) {
    location.replace(planPage(state.checkpoints[0].id, location.search));
    return;
  }
  runPanel = new RunPanel($('run-panel'), { onOpened: stepOpened });
  runPanel.setServed(state.checkpoints);
  if (await runPanel.load()) {
    timeline = new Timeline($('timeline'), { link: $('timeline-link'), listing: () => runPanel.listing,
      onStep: (step) => runPanel.openStep(step), onPair: (layer) => stepOpened({ id: 'diff', layer }),
      onClose: () => { location.hash = writtenHash || ''; } });
  }
  updateShareTitles();
  await applyRoute();
  forgetEarly();
  document.body.dataset.ready = '1';
  resolveReady(state);
}

Object.defineProperty(state, 'heatmap', { enumerable: true, get: () => (heatmap ? heatmap.snapshot() : null) });
Object.defineProperty(state, 'run', { enumerable: true, get: () => (runPanel ? runPanel.listing : null) });  // /api/run

window.tensormorph = {
  state,
  ready,
  /** Open a tensor of the active checkpoint (tests and the console). */
  select: (name, options) => selectTensor(name, options),
  route: () => parseRoute(location.hash),
  setRank: (rank) => setRank(rank),
  go: (ck) => activate(ck),
};

boot().catch(fail);
