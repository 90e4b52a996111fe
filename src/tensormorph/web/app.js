// Tensormorph viewer: routing, state and wiring of the views. Plain ES modules, no build step,
// nothing fetched but the API of the server that serves this page.
//
// The URL hash holds what is on screen (#ck=a&t=NAME&rank=R, #ck=diff&t=NAME&kind=absdiff), so a
// view can be bookmarked or shared; the query string is left to the server (?token=...).

import { ApiError, getJSON } from './api.js';
import { DiffView, statusLabel } from './diff.js';
import { bytes, count, el, int, midName, shape as fmtShape } from './format.js';
import { Heatmap } from './heatmap.js';
import { Inspector } from './inspector.js';
import { TreeView } from './tree.js';

const $ = (id) => document.getElementById(id);

const CONFIG_LABELS = [
  ['architectures', 'architecture'], ['model_type', 'model type'], ['num_hidden_layers', 'layers'],
  ['hidden_size', 'hidden size'], ['num_attention_heads', 'attention heads'], ['num_key_value_heads', 'KV heads'],
  ['intermediate_size', 'intermediate size'], ['vocab_size', 'vocabulary'], ['torch_dtype', 'torch dtype'],
];

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
let tensorRequest = 0;
const savedSettings = { tensor: null, diff: null };

// ---------------------------------------------------------------- routing

function readRoute() {
  const p = new URLSearchParams(location.hash.slice(1));
  const rank = p.get('rank');
  return { ck: p.get('ck'), t: p.get('t'), rank: rank === null || rank === '' ? null : Number(rank), kind: p.get('kind') };
}

function writeRoute() {
  const p = new URLSearchParams();
  if (state.active) p.set('ck', state.active);
  if (state.active === 'diff') {
    if (state.diffSelection) p.set('t', state.diffSelection.name);
    if (state.kind !== 'diff') p.set('kind', state.kind);
  } else if (state.selection) {
    p.set('t', state.selection.name);
    if (state.rank !== null) p.set('rank', String(state.rank));
  }
  const hash = `#${p.toString()}`;
  if (hash !== location.hash) history.replaceState(null, '', `${location.pathname}${location.search}${hash}`);
}

async function applyRoute() {
  const route = readRoute();
  const ids = state.checkpoints.map((c) => c.id);
  const ck = route.ck === 'diff' && ids.length > 1 ? 'diff' : ids.includes(route.ck) ? route.ck : ids[0];
  if (route.kind === 'absdiff' || route.kind === 'diff') state.kind = route.kind;
  if (ck !== state.active) await activate(ck);
  if (ck === 'diff') {
    if (route.t && (!state.diffSelection || state.diffSelection.name !== route.t)) {
      const rec = diffView.select(route.t);
      if (rec) showDiffTensor(rec);
    }
  } else if (route.t && (!state.selection || state.selection.name !== route.t || state.rank !== route.rank)) {
    await selectTensor(route.t, { rank: route.rank });
  }
}

// ---------------------------------------------------------------- header

function renderTabs() {
  const tabs = $('tabs');
  tabs.replaceChildren();
  for (const c of state.checkpoints) {
    const name = c.path.split(/[\\/]/).filter(Boolean).pop() || c.path;
    const tab = el('button', {
      type: 'button', class: `tab${state.active === c.id ? ' on' : ''}`, role: 'tab', 'data-testid': `tab-${c.id}`,
      'aria-selected': String(state.active === c.id), title: `${c.path}\n${c.format} · ${int(c.tensor_count)} tensors`,
      onclick: () => go(c.id),
    }, el('span', { class: 'id' }, c.id.toUpperCase()), el('span', { class: 'path' }, name), el('span', { class: 'fmt' }, c.format));
    tabs.append(tab);
  }
  if (state.checkpoints.length > 1) {
    tabs.append(el('button', {
      type: 'button', class: `tab${state.active === 'diff' ? ' on' : ''}`, role: 'tab', 'data-testid': 'tab-diff',
      'aria-selected': String(state.active === 'diff'), title: 'Compare A and B, tensor by tensor', onclick: () => go('diff'),
    }, el('span', { class: 'id' }, 'A ⇄ B'), el('span', {}, 'Diff')));
  }
}

function renderCheckpointInfo() {
  const info = $('ckinfo');
  if (state.active === 'diff') {
    const [a, b] = state.checkpoints;
    info.replaceChildren(el('span', { class: 'path', title: a.path }, a.path), el('span', {}, 'vs'),
      el('span', { class: 'path', title: b.path }, b.path));
    return;
  }
  const s = state.summaries[state.active];
  if (!s) return;
  info.replaceChildren(
    el('span', { class: 'path', title: s.path, 'data-testid': 'checkpoint-path' }, s.path),
    el('span', { 'data-testid': 'checkpoint-format' }, el('b', {}, s.format)),
    el('span', {}, el('b', {}, int(s.tensor_count)), ' tensors'),
    el('span', { title: `${int(s.params)} elements` }, el('b', {}, count(s.params)), ' params'),
    el('span', { title: `${int(s.nbytes)} bytes` }, el('b', {}, bytes(s.nbytes))),
    el('span', {}, el('b', {}, int(s.files.length)), ` file${s.files.length === 1 ? '' : 's'}`));
}

function renderConfig(summary) {
  const box = $('config');
  const config = summary.config;
  if (!config) {
    box.hidden = true;
    return;
  }
  const dl = el('dl', {});
  for (const [key, label] of CONFIG_LABELS) {
    let v = config[key];
    if (v === null || v === undefined) continue;
    if (Array.isArray(v)) v = v.join(', ');
    dl.append(el('dt', {}, label), el('dd', { 'data-config': key }, typeof v === 'number' ? int(v) : String(v)));
  }
  const title = [config.architectures && config.architectures[0], config.model_type].filter(Boolean).join(' · ') || 'config.json';
  box.replaceChildren(el('summary', {}, `Model: ${title}`), dl);
  box.hidden = false;
}

// ---------------------------------------------------------------- modes

async function loadSummary(id) {
  if (!state.summaries[id]) state.summaries[id] = await getJSON(`/api/checkpoints/${id}/summary`);
  return state.summaries[id];
}

async function activate(ck) {
  const wasDiff = state.active === 'diff';
  state.active = ck;
  renderTabs();
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
  await heatmap.setSource(null);
  if (diffMode) {
    renderCheckpointInfo();
    setTitle('Select a tensor in the diff table');
    inspector.message('Pick a row of the diff table to see a − b.');
    if (!diffView) diffView = new DiffView($('diff-pane'), { onSelect: (rec) => showDiffTensor(rec) });
    if (!state.diff) state.diff = await diffView.load();
    welcome();
  } else {
    const summary = await loadSummary(ck);
    renderCheckpointInfo();
    renderConfig(summary);
    tree.setSummary(summary);
    inspector.showCheckpoint(summary);
    setTitle('No tensor selected');
    welcome();
  }
  writeRoute();
}

function go(ck) {
  activate(ck).catch(fail);
}

function kindSettings(kind) {
  return kind === 'absdiff' ? { cmap: 'magma', norm: 'linear', agg: 'absmax' } : { cmap: 'diverging', norm: 'symmetric', agg: 'absmax' };
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
  const largest = [...summary.tensors].sort((x, y) => y.nbytes - x.nbytes).slice(0, 8);
  box.replaceChildren(el('div', { class: 'welcome' }, el('h3', {}, 'Pick a tensor on the left, or one of the largest:'),
    ...largest.map((t) => el('button', { type: 'button', onclick: () => selectTensor(t.name) },
      midName(t.name), el('span', { class: 'muted' }, `${fmtShape(t.shape)} · ${bytes(t.nbytes)}`)))));
}

function setTitle(text, detail = '') {
  const title = $('view-title');
  title.replaceChildren(text);
  if (detail) title.append(el('small', {}, detail));
}

// ---------------------------------------------------------------- tensor selection

/**
 * The shape of what `rank` holds, as the server's local view has it (core.local_tensor): its one
 * non-empty chunk's shape, the 1-D run of several chunks, or an empty chunk's shape.
 */
function localShape(record, rank) {
  const numel = (c) => c.shape.reduce((a, b) => a * b, 1);
  const held = record.chunks.filter((c) => c.ranks.includes(rank));
  const full = held.filter((c) => numel(c) > 0);
  if (full.length > 1) return [full.reduce((n, c) => n + numel(c), 0)];
  const one = full[0] || held[0];
  return one ? one.shape : [0];
}

function tensorSource(ck, record, rank) {
  return {
    tensorKey: `${ck}|${record.name}`,
    endpoint: `/api/checkpoints/${ck}/tile`,
    params: { name: record.name, rank },
    dims: rank === null ? record.shape : localShape(record, rank),  // the axes selector shows what is drawn
    chunks: rank === null ? record.chunks : null,
    probe: rank !== null,  // a local view's shape is the server's to say
    // local(rank) indices are within the rank's chunk: the hover readout adds its offsets
    indexOffset: rank === null ? null : (record.chunks.find((c) => c.ranks.includes(rank)) || {}).offsets || null,
  };
}

async function selectTensor(name, { rank = null } = {}) {
  if (state.active === 'diff' || !state.active) return;
  const ck = state.active;
  const seq = ++tensorRequest;
  state.selection = { ck, name };
  tree.reveal(name);
  $('canvas-message').replaceChildren();
  setTitle(name, 'loading…');
  let record;
  try {
    record = await getJSON(`/api/checkpoints/${ck}/tensor`, { name });
  } catch (err) {
    if (seq !== tensorRequest) return;
    setTitle(name);
    state.record = null;
    await heatmap.setSource(null);  // not the previous tensor's image under the error
    heatmap.setMessage(`Could not open the tensor: ${err.message}`, { error: true });
    return;
  }
  if (seq !== tensorRequest) return;
  state.record = record;
  state.rank = rank !== null && (record.ranks || []).includes(rank) ? rank : null;
  showRecord();
  writeRoute();
}

function showRecord() {
  const { record, rank } = state;
  const ck = state.selection.ck;
  setTitle(record.name, `${record.dtype} · ${fmtShape(record.shape)} · ${rank === null ? 'full()' : `local(${rank})`}`);
  inspector.showTensor(ck, record, rank);
  if (record.shape.includes(0)) {
    heatmap.setSource(null);
    heatmap.setMessage('empty tensor: no elements to draw');
    return;
  }
  if (rank !== null && localShape(record, rank).includes(0)) {
    heatmap.setSource(null);
    heatmap.setMessage(`rank ${rank} holds 0 of ${int(record.numel)} elements`);
    return;
  }
  heatmap.setSource(tensorSource(ck, record, rank));
}

function setRank(rank) {
  if (!state.record) return;
  state.rank = rank;
  showRecord();
  writeRoute();
}

function showDiffTensor(rec) {
  state.diffSelection = rec;
  inspector.showDiff(rec);
  writeRoute();
  const elementwise = rec.shape_a && rec.shape_b && JSON.stringify(rec.shape_a) === JSON.stringify(rec.shape_b);
  setTitle(rec.name, `${statusLabel(rec.status)} · ${state.kind === 'diff' ? 'a − b' : '|a − b|'}`);
  if (!elementwise) {
    heatmap.setSource(null);
    const why = rec.status === 'only_a' ? 'only in A' : rec.status === 'only_b' ? 'only in B' : 'shapes differ';
    heatmap.setMessage(`No element-wise difference to draw: ${why}.`);
    return;
  }
  heatmap.setSource({
    tensorKey: `diff|${rec.name}`,
    endpoint: '/api/diff/tile',
    params: { name: rec.name, kind: state.kind },
    dims: rec.shape_a,
    chunks: null,
    probe: false,
  });
}

// ---------------------------------------------------------------- keyboard

function onKey(e) {
  const target = e.target;
  const typing = target.closest && target.closest('input, select, textarea');
  if (e.key === 'Escape') {
    $('help').hidden = true;
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
    clipInput: $('clip'), clipWrap: $('clip-wrap'),
    onHover: (info) => inspector.highlight(info),
  });
  inspector = new Inspector($('inspector'), {
    onRank: (rank) => setRank(rank),
    onFocusIndex: (index) => heatmap.focusIndex(index),
  });
  tree = new TreeView({
    list: $('tree-list'), status: $('list-status'), search: $('search'), modeToggle: $('mode-toggle'),
    onSelect: (name) => selectTensor(name),
  });
  $('diff-kind').addEventListener('change', () => {
    state.kind = $('diff-kind').value;
    heatmap.set(kindSettings(state.kind));
    if (state.diffSelection) showDiffTensor(state.diffSelection);
    writeRoute();
  });
  $('plan-link').href = `plan.html${location.search}`;  // the token travels with it
  $('help-button').addEventListener('click', () => { $('help').hidden = !$('help').hidden; });
  $('help').addEventListener('click', (e) => { if (e.target === $('help')) $('help').hidden = true; });
  document.addEventListener('keydown', onKey);
  window.addEventListener('hashchange', () => applyRoute().catch(fail));

  state.checkpoints = await getJSON('/api/checkpoints');
  if (!state.checkpoints.length) throw new Error('the server lists no checkpoints');
  const route = readRoute();
  if (route.kind) state.kind = route.kind;
  $('diff-kind').value = state.kind;
  await applyRoute();
  document.body.dataset.ready = '1';
  resolveReady(state);
}

Object.defineProperty(state, 'heatmap', { enumerable: true, get: () => (heatmap ? heatmap.snapshot() : null) });

window.tensormorph = {
  state,
  ready,
  /** Open a tensor of the active checkpoint (tests and the console). */
  select: (name, options) => selectTensor(name, options),
  setRank: (rank) => setRank(rank),
  go: (ck) => activate(ck),
};

boot().catch(fail);
