// The notebook heatmap widget (anywidget's render): a tensor's 2-D view with pan and zoom, whose tiles the kernel
// sends by custom messages (tensormorph/widget.py answers with the tiles of ops/tiles.py, in the viewer's binary
// encoding). The viewer's own camera, renderer, pointer handling, colour maps and tile parser draw it: widget.py
// inlines those modules when it builds this one, so the widget shows what the page shows and loads nothing from the
// network. Text from the kernel (the tensor's name, error messages) is only ever set as textContent: data, never
// markup.

import { parseTile } from './api.js';
import { Camera, ViewSlice } from './camera.js';
import { COLORMAP_LABELS, NORMALISATIONS } from './colormaps.js';
import { HoverReadout, attachPointer } from './pointer.js';
import { Renderer } from './render.js';
import { covers } from './tiles.js';

const KEEP_TILES = 4;  // tiles kept under the newest, so that a pan never flashes blank
const FETCH_DELAY_MS = 70;  // pans and zooms within this settle into one request
const AGG_LABELS = { auto: 'auto', mean: 'mean', min: 'min', max: 'max', absmax: 'abs-max' };
const CSS = `
.tm-widget{font:12px system-ui,sans-serif;color:#1c2430;max-width:100%}
.tm-widget .tm-bar{display:flex;gap:6px;align-items:center;flex-wrap:wrap;margin-bottom:4px}
.tm-widget .tm-title{font-weight:600;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;max-width:60%}
.tm-widget canvas.tm-canvas{display:block;width:100%;cursor:grab;touch-action:none;border:1px solid #c8ced8}
.tm-widget canvas.tm-canvas.dragging{cursor:grabbing}
.tm-widget .tm-foot{display:flex;gap:8px;align-items:center;margin-top:4px;min-height:16px}
.tm-widget canvas.tm-colorbar{width:160px;height:10px;image-rendering:pixelated;border:1px solid #aab}
.tm-widget .tm-readout{font-family:ui-monospace,Menlo,monospace;white-space:pre;overflow:hidden;text-overflow:ellipsis}
.tm-widget .tm-message{color:#667}
.tm-widget .tm-message.error{color:#c0392b;font-weight:600}
.tm-widget select,.tm-widget button{font:inherit}
`;

function make(tag, className, parent, text = '') {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  parent.appendChild(node);
  return node;
}

/** A <select> of `labels` ({value: label}) that calls onChange(value). */
function choice(parent, title, labels, onChange) {
  const box = make('select', '', parent);
  box.title = title;
  for (const [value, label] of Object.entries(labels)) make('option', '', box, label).value = value;
  box.addEventListener('change', () => onChange(box.value));
  return box;
}

/** The tiles of one view, asked of the kernel: a strided sample first, then the exact tile, as tiles.js does. */
class TileRequests {
  constructor(model, { wanted, viewShape, onTile, onError }) {
    Object.assign(this, { model, wanted, viewShape, onTile, onError });
    this.layers = [];  // oldest first; each tile has reg (what was asked), exact and limited
    this.pending = null;  // {id, reg, exact}: answers to any other id are dropped
    this.nextId = 1;
    this.timer = undefined;
  }

  get newest() { return this.layers[this.layers.length - 1]; }

  clear() {
    clearTimeout(this.timer);
    this.layers = [];
    this.pending = null;
  }

  schedule() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.fetchVisible(), FETCH_DELAY_MS);
  }

  fetchVisible() {
    const reg = this.wanted();
    if (!reg) return;
    const covering = this.layers.filter((t) => covers(t.reg, reg));
    if (covering.some((t) => t.exact || t.limited)) return;  // limited: no exact tile will come for it
    if (this.pending && covers(this.pending.reg, reg)) return;
    this.ask(reg, covering.length > 0);
  }

  ask(reg, exact) {
    const id = this.nextId++;
    this.pending = { id, reg, exact };
    this.model.send({ type: 'tile', id, r0: reg.r0, r1: reg.r1, c0: reg.c0, c1: reg.c1, h: reg.h, w: reg.w, exact });
  }

  /** An answer of the kernel: {type: 'tile'|'error', id, ...} and the encoded tile as its one buffer. */
  receive(msg, buffers) {
    const asked = this.pending;
    if (!asked || !msg || msg.id !== asked.id) return;
    this.pending = null;
    if (msg.type === 'error') {
      this.onError(String(msg.error));
      return;
    }
    let tile;
    try {
      tile = parseTile(asBuffer(buffers && buffers[0]));
    } catch (err) {
      this.onError(`the kernel's tile could not be read: ${err.message}`);
      return;
    }
    const [vh, vw] = tile.header.view_shape;
    const [H, W] = this.viewShape();
    if (vh !== H || vw !== W) return;  // a tile of the tensor shown before
    tile.reg = asked.reg;
    tile.exact = !tile.header.approximate;
    tile.limited = Boolean(msg.limited);
    if (tile.exact) this.layers = this.layers.filter((t) => !(!t.exact && covers(tile.reg, t.reg)));
    this.layers.push(tile);
    if (this.layers.length > KEEP_TILES) this.layers.splice(0, this.layers.length - KEEP_TILES);
    this.onTile(tile);
    if (!tile.exact && !tile.limited && !asked.exact) this.ask(asked.reg, true);
  }

  /** The newest tile that holds view element (r, c). */
  tileAt(r, c) {
    return [...this.layers].reverse().find((t) =>
      t.header.rows[0] <= r && r < t.header.rows[1] && t.header.cols[0] <= c && c < t.header.cols[1]);
  }
}

/** A message buffer (a DataView from Jupyter, an ArrayBuffer elsewhere) as an ArrayBuffer of its own bytes. */
function asBuffer(buffer) {
  if (!buffer) throw new Error('no buffer came with the tile');
  if (buffer instanceof ArrayBuffer) return buffer;
  return buffer.buffer.slice(buffer.byteOffset, buffer.byteOffset + buffer.byteLength);
}

function render({ model, el }) {
  const root = make('div', 'tm-widget', el);
  make('style', '', root).textContent = CSS;
  const bar = make('div', 'tm-bar', root);
  const title = make('span', 'tm-title', bar);
  const set = (key, value) => {
    model.set(key, value);
    model.save_changes();
  };
  const cmapBox = choice(bar, 'colour map', COLORMAP_LABELS, (v) => set('cmap', v));
  const normBox = choice(bar, 'normalisation', NORMALISATIONS, (v) => set('norm', v));
  const aggBox = choice(bar, 'block summary', AGG_LABELS, (v) => set('agg', v));
  const button = (text, label, onClick) => {
    const b = make('button', '', bar, text);
    b.title = label;
    b.addEventListener('click', onClick);
  };
  const canvas = make('canvas', 'tm-canvas', root);
  canvas.tabIndex = 0;
  const foot = make('div', 'tm-foot', root);
  const legendLo = make('span', '', foot);
  const colorbar = make('canvas', 'tm-colorbar', foot);
  const legendHi = make('span', '', foot);
  const message = make('span', 'tm-message', foot);
  const readoutEl = make('div', 'tm-readout', root, '\u00a0');

  const camera = new Camera(canvas);
  const renderer = new Renderer(canvas, camera.dpr, { legendLo, legendHi, colorbar });
  const slice = new ViewSlice();
  const readout = new HoverReadout(readoutEl, () => {});
  const source = { indexOffset: null, chunks: [] };
  let failed = false;

  const settings = () => ({ cmap: model.get('cmap'), norm: model.get('norm'), agg: model.get('agg'), clip: 1,
    lock: model.get('value_range') !== null });
  const lockedRange = () => {
    const range = model.get('value_range');
    return range ? { min: range[0], max: range[1], absMax: Math.max(Math.abs(range[0]), Math.abs(range[1])) } : null;
  };
  const tiles = new TileRequests(model, {
    wanted: () => camera.region(),
    viewShape: () => [camera.H, camera.W],
    onTile: (tile) => {
      failed = false;
      showMessage(tile.limited ? 'a strided sample: the exact tile of this region reads more than the widget '
        + 'allows; zoom in for exact values' : tile.exact ? '' : 'approximate (a strided sample): exact loading…');
      renormalise();
      draw();
      updateHover();
    },
    onError: (text) => {
      failed = true;
      tiles.layers = [];
      showMessage(text, true);
      renormalise();
      draw();
    },
  });

  function showMessage(text, error = false) {
    message.classList.toggle('error', error);
    message.textContent = text;
  }

  function renormalise() {
    renderer.renormalise(tiles.layers, settings(), lockedRange(), camera.region());
  }

  function draw() {
    const shown = camera.W && !failed;
    renderer.draw(shown ? { camera, layers: tiles.layers, settings: settings(), boxes: [], hotChunk: -1,
      hoverBlock: readout.block, pinned: null } : null);
  }

  function updateHover() {
    readout.update({ source, camera, slice, tiles });
  }

  function afterCamera() {
    renormalise();
    draw();
    updateHover();
    tiles.schedule();
  }

  /** A new tensor or view: its shape and axes from the traits, the camera fitted, its first tile asked. */
  function showView() {
    title.textContent = model.get('title');
    title.title = model.get('title');
    const shape = model.get('shape');
    slice.reset(shape);
    if (shape.length >= 2) slice.restore(model.get('axes'), model.get('fixed'));
    const [H, W] = model.get('view_shape');
    tiles.clear();
    renderer.fitKey = '';
    failed = false;
    const empty = H * W === 0;
    camera.H = empty ? 0 : H;  // no view: nothing to pan over or ask for
    camera.W = empty ? 0 : W;
    showMessage(empty ? 'empty tensor: no elements to draw' : '');
    if (!empty) camera.fit();
    afterCamera();
  }

  function syncSettings() {
    cmapBox.value = model.get('cmap');
    normBox.value = model.get('norm');
    aggBox.value = model.get('agg');
    renormalise();
    draw();
    updateHover();
  }

  function resize() {
    const width = Math.max(1, Math.round(canvas.clientWidth * camera.dpr));
    canvas.style.height = `${model.get('height')}px`;
    const height = Math.max(1, Math.round(model.get('height') * camera.dpr));
    if (!camera.resize(width, height)) return;
    if (camera.W && camera.atFit) camera.fit();
    afterCamera();
  }

  button('−', 'zoom out', () => { if (camera.zoomAt(canvas.width / 2, canvas.height / 2, 0.5)) afterCamera(); });
  button('+', 'zoom in', () => { if (camera.zoomAt(canvas.width / 2, canvas.height / 2, 2)) afterCamera(); });
  button('fit', 'show the whole view', () => { if (camera.fit()) afterCamera(); });
  attachPointer(canvas, {
    dpr: camera.dpr,
    hasView: () => camera.W > 0,
    panBy: (dx, dy) => { if (camera.panBy(dx, dy)) afterCamera(); },
    zoomAt: (px, py, factor) => { if (camera.zoomAt(px, py, factor)) afterCamera(); },
    hoverAt: (position) => {
      readout.position = position;
      updateHover();
      draw();
    },
    clickAt: () => {},
  });

  const onMessage = (msg, buffers) => tiles.receive(msg, buffers);
  const onError = () => { if (model.get('error')) showMessage(model.get('error'), true); };
  model.on('msg:custom', onMessage);
  model.on('change:title', showView);
  model.on('change:cmap change:norm change:agg change:value_range', syncSettings);
  model.on('change:height', resize);
  model.on('change:error', onError);
  const observer = new ResizeObserver(resize);
  observer.observe(canvas);
  syncSettings();
  resize();
  showView();
  return () => {
    observer.disconnect();
    tiles.clear();
    model.off('msg:custom', onMessage);
    model.off('change:title', showView);
    model.off('change:cmap change:norm change:agg change:value_range', syncSettings);
    model.off('change:height', resize);
    model.off('change:error', onError);
  };
}

export default { render };
