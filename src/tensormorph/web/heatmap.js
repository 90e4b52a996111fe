// The Matrix/Heatmap view: a canvas showing any tensor as a 2-D view (1-D as a strip, N-D by
// choosing two axes and fixing the rest), with pan and zoom from the whole tensor down to single
// elements. This class composes the parts and keeps them in step:
//   camera.js    the view slice of the tensor and the zoom/pan arithmetic
//   tiles.js     tile requests, the loaded tiles, cancellation
//   render.js    colour mapping and drawing onto the canvas, the legend
//   pointer.js   drag, wheel and double-click on the canvas; the hover readout
//   controls.js  the toolbar: settings, zoom buttons, axes choice
//   rulers.js    the row and column index rulers
//   pin.js       the pinned element's card
// Keyboard shortcuts are app.js's, which calls zoomBy, fit, zoomOneToOne, panBy, cycle and unpin.
// What is on screen (axes, zoom, centre, pin) is viewState(); setSource(source, {view}) brings it back.

import { Camera, ViewSlice } from './camera.js';
import { bindSettingsControls, renderAxesControls, syncSettingsControls } from './controls.js';
import { PinCard } from './pin.js';
import { HoverReadout, attachPointer } from './pointer.js';
import { Renderer } from './render.js';
import { Rulers } from './rulers.js';
import { TileLoader, probeViewShape } from './tiles.js';

/** The display settings of a fresh page: 'auto' is mean on a diverging map, abs-max on the others. */
export const DEFAULT_SETTINGS = { agg: 'auto', cmap: 'viridis', norm: 'linear', clip: 1, lock: false };

export class Heatmap {
  constructor(parts) {
    Object.assign(this, parts);  // canvas, wrap, buttons, labels, onHover, onViewChange (see app.js)
    this.settings = { ...DEFAULT_SETTINGS };
    this.source = null;
    this.range = null;  // the tensor's {min, max, absMax}, for a scale locked to it
    this.pin = null;  // the pinned tensor index
    this.failed = false;  // the last request failed: draw nothing until a tile arrives
    this.slice = new ViewSlice();
    this.camera = new Camera(this.canvas);
    this.rulers = new Rulers(this.rulerTop, this.rulerLeft, this.camera.dpr);
    this.pinCard = new PinCard(this.pinEl, { close: () => this.unpin(), copy: () => this.onCopyPin() });
    this.renderer = new Renderer(this.canvas, this.camera.dpr,
      { legendLo: this.legendLo, legendHi: this.legendHi, colorbar: this.colorbar });
    this.tiles = new TileLoader({
      wanted: () => this.wantedTile(),
      viewShape: () => [this.camera.H, this.camera.W],
      onViewShape: (H, W) => this.adoptViewShape(H, W),
      onTile: (tile) => this.tileArrived(tile),
      onError: (err) => this.showError(err),
    });
    this.readout = new HoverReadout(this.hoverEl, (info) => { if (this.onHover) this.onHover(info); });
    bindSettingsControls(this, this.settings,
      { set: (changes) => this.set(changes), zoomBy: (factor) => this.zoomBy(factor), fit: () => this.fit() });
    attachPointer(this.canvas, {
      dpr: this.camera.dpr,
      hasView: () => this.camera.W > 0,
      panBy: (dx, dy) => this.panBy(dx, dy),
      zoomAt: (px, py, factor) => this.zoomAt(px, py, factor),
      hoverAt: (position) => {
        this.readout.position = position;
        this.updateHover();
        this.scheduleDraw();
      },
      clickAt: (px, py) => this.pinAt(px, py),
    });
    new ResizeObserver(() => this.resize()).observe(this.wrap);
    this.resize();
  }

  // ---------------------------------------------------------------- settings

  /** Change display settings: recolours what is loaded, never requests anything. */
  set(changes) {
    Object.assign(this.settings, changes);
    this.renormalise();
    this.draw();
    this.updateHover();
    this.changed();
  }

  /** The tensor's global range {min, max, absMax} (null: unknown), which the locked scale uses. */
  setRange(range) {
    this.range = range;
    this.renormalise();
    this.draw();
  }

  /** The range the scale locks to: the page's (statistics, diff report), else the tiles' X-Tensormorph-Scale. */
  lockRange() {
    if (this.range) return this.range;
    const scale = this.tiles.layers.map((t) => t.scale).filter(Boolean).pop();
    const finite = scale && [scale.min, scale.max, scale.absmax].every(Number.isFinite);
    return finite ? { min: scale.min, max: scale.max, absMax: scale.absmax } : null;
  }

  cycle(key, names) {
    const i = names.indexOf(this.settings[key]);
    this.set({ [key]: names[(i + 1) % names.length] });
  }

  // ---------------------------------------------------------------- source and view

  /**
   * Show a tensor. source: {tensorKey, endpoint, params, dims, chunks, probe, indexOffset, record, sides}
   * or null. params are the fixed query parameters (name, rank, kind); probe asks the server for
   * the view shape (needed for local(rank) views, whose shape only the server knows). view: a
   * viewState() to bring back (a link, a history entry); without it the same tensor keeps its camera.
   */
  async setSource(source, { view = null } = {}) {
    const sameTensor = this.source && source && this.source.tensorKey === source.tensorKey
      && JSON.stringify(this.source.dims) === JSON.stringify(source.dims);
    this.source = source;
    this.failed = false;
    this.tiles.clear();
    this.renderer.fitKey = '';  // another tensor: its first tile sets the scale afresh
    this.renormalise();  // the legend goes with the tiles
    this.readout.reset();
    this.setMessage('');
    if (!sameTensor || view) this.unpin({ quiet: true });
    if (!source) {
      this.range = null;
      this.camera.H = this.camera.W = 0;
      this.renderAxes();
      this.draw();
      this.updateZoomLabel();
      this.updateBadge();
      this.readout.clear();
      return;
    }
    if (!sameTensor) this.slice.reset(source.dims);
    if (view) this.slice.restore(view.axes, view.fixed);
    this.renderAxes();
    await this.applyView({ keepCamera: sameTensor && !view, view });
  }

  /** Bring back a viewState() on the tensor already shown. */
  async restoreView(view) {
    if (!this.source) return;
    this.unpin({ quiet: true });
    this.slice.restore(view.axes, view.fixed);
    this.renderAxes();
    await this.applyView({ view });
  }

  async applyView({ keepCamera = false, view = null } = {}) {
    const { source, camera } = this;
    const generation = this.tiles.restart();
    let [H, W] = this.slice.shape();
    if (source.probe) {
      try {
        [H, W] = await probeViewShape(source.endpoint, { ...source.params, ...this.slice.params() });
      } catch (err) {
        if (!this.tiles.isCurrent(generation)) return;
        camera.H = camera.W = 0;  // no view to pan over: the previous one is not this tensor's
        this.showError(err);
        return;
      }
      if (!this.tiles.isCurrent(generation)) return;
    }
    const changed = H !== camera.H || W !== camera.W;
    camera.H = H;
    camera.W = W;
    if (H === 0 || W === 0) {
      this.setMessage('empty tensor: no elements to draw');
      this.draw();
      return;
    }
    if (view && view.zoom && view.at) {
      camera.setView(view.zoom, view.at[0], view.at[1]);
      this.updateZoomLabel();
    } else if (!keepCamera || changed || !camera.fitted) {
      this.fit({ fetch: false });
    }
    if (view && view.pin && view.pin.length === source.dims.length) this.pinIndex(view.pin);
    this.draw();
    this.tiles.fetchVisible();
    this.changed();
  }

  /** The server knows the view better (local views, unusual ranks): adopt its shape and refit. */
  adoptViewShape(H, W) {
    this.camera.H = H;
    this.camera.W = W;
    this.fit();
  }

  renderAxes() {
    renderAxesControls(this.axesBox, this.source && this.slice, {
      onAxes: () => {
        this.renderAxes();
        this.applyView();
      },
      onFixed: () => this.applyView({ keepCamera: true }),
    });
  }

  /** What a link needs to bring this view back: axes, fixed indices, zoom and centre (none at fit), pin. */
  viewState() {
    const { camera, slice, source } = this;
    if (!source) return null;
    const nd = source.dims.length;
    const state = { axes: nd >= 2 ? [...slice.axes] : null, fixed: nd > 2 ? [...slice.fixed] : null, zoom: null, at: null,
      pin: this.pin ? [...this.pin] : null };
    if (camera.W && !camera.atFit) {
      state.zoom = camera.z / camera.dpr;
      state.at = camera.centre();
    }
    return state;
  }

  /** Tell the owner that the view changed (the URL follows it). */
  changed() {
    if (this.onViewChange) this.onViewChange();
  }

  // ---------------------------------------------------------------- camera

  resize() {
    const { camera, canvas } = this;
    const w = Math.max(1, Math.round(canvas.clientWidth * camera.dpr));
    const h = Math.max(1, Math.round(canvas.clientHeight * camera.dpr));
    this.rulers.resize();
    if (!camera.resize(w, h)) {
      this.draw();  // the rulers' canvases were cleared
      return;
    }
    if (camera.W && camera.atFit) this.fit();
    else if (camera.W) this.tiles.schedule();
    this.draw();
  }

  fit({ fetch = true } = {}) {
    if (this.camera.fit()) this.afterCamera(fetch);
  }

  /** Zoom by a factor keeping the element under canvas point (px, py) in place. */
  zoomAt(px, py, factor) {
    if (this.camera.zoomAt(px, py, factor)) this.afterCamera(true);
  }

  zoomBy(factor) {
    this.zoomAt(this.canvas.width / 2, this.canvas.height / 2, factor);
  }

  /** One element per CSS pixel ("1:1"). */
  zoomOneToOne() {
    if (this.camera.W) this.zoomBy(this.camera.dpr / this.camera.z);
  }

  panBy(dx, dy) {
    if (this.camera.panBy(dx, dy)) this.afterCamera(true);
  }

  /** Centre the view on view element (r, c) at full zoom. */
  focusElement(r, c) {
    if (this.camera.focusElement(r, c)) this.afterCamera(true);
  }

  /** Show tensor element `index` at full zoom, fixing the non-displayed dimensions to its own. */
  async focusIndex(index) {
    if (!this.source || !index) return;
    const nd = this.source.dims.length;
    if (nd === 0) return;
    if (nd === 1) {
      this.focusElement(0, index[0]);
      return;
    }
    const fixed = this.slice.fixedOf(index);
    if (fixed.join(',') !== this.slice.fixed.join(',')) {
      this.slice.fixed = fixed;
      this.renderAxes();
      await this.applyView({ keepCamera: true });
    }
    const [ay, ax] = this.slice.axes;
    this.focusElement(index[ay], index[ax]);
  }

  /** Show the box at `offsets` of `shape` (a chunk) whole, the other dimensions fixed at its start. */
  async focusBox(offsets, shape) {
    const nd = this.source ? this.source.dims.length : 0;
    if (nd === 0) return;
    let [r0, r1, c0, c1] = [0, 1, offsets[0], offsets[0] + shape[0]];
    if (nd > 1) {
      const fixed = this.slice.fixedOf(offsets);
      if (fixed.join(',') !== this.slice.fixed.join(',')) {
        this.slice.fixed = fixed;
        this.renderAxes();
        await this.applyView({ keepCamera: true });
      }
      const [ay, ax] = this.slice.axes;
      [r0, r1, c0, c1] = [offsets[ay], offsets[ay] + shape[ay], offsets[ax], offsets[ax] + shape[ax]];
    }
    const { camera } = this;
    if (!camera.W || r1 <= r0 || c1 <= c0) return;
    const zoom = Math.min(camera.canvas.width / (c1 - c0), camera.canvas.height / (r1 - r0)) / camera.dpr;
    if (camera.setView(zoom, (r0 + r1) / 2, (c0 + c1) / 2)) this.afterCamera(true);
  }

  afterCamera(fetch) {
    this.renormalise();  // the scale follows the visible values (a repaint only when it changes)
    this.updateZoomLabel();
    this.scheduleDraw();
    this.updateHover();
    if (fetch) this.tiles.schedule();
    this.changed();
  }

  /** The visible region as a tensor index: one [start, stop] per shown dimension, the fixed indices. */
  regionIndex() {
    const vis = this.camera.visible();
    if (!this.source || !vis) return null;
    const nd = this.source.dims.length;
    if (nd === 0) return [];
    if (nd === 1) return [[vis.c0, vis.c1]];
    const [ay, ax] = this.slice.axes;
    let k = 0;
    return this.source.dims.map((_, d) => (d === ay ? [vis.r0, vis.r1] : d === ax ? [vis.c0, vis.c1] : this.slice.fixed[k++]));
  }

  // ---------------------------------------------------------------- pinning

  /** Pin the element under canvas point (px, py); a click on the pinned element unpins it. */
  pinAt(px, py) {
    const { camera } = this;
    if (!this.source || !camera.W) return;
    const [r, c] = camera.elementAt(px, py);
    if (r < 0 || c < 0 || r >= camera.H || c >= camera.W) return;
    const index = this.slice.tensorIndex(r, c);
    if (this.pin && index.join(',') === this.pin.join(',')) this.unpin();
    else this.pinIndex(index);
  }

  pinIndex(index) {
    this.pin = index;
    this.pinCard.show(this.source, index, this.slice.axes);
    this.scheduleDraw();
    this.changed();
  }

  unpin({ quiet = false } = {}) {
    if (!this.pin) return;
    this.pin = null;
    this.pinCard.hide();
    this.scheduleDraw();
    if (!quiet) this.changed();
  }

  /**
   * Show a search's answer (find.js): its view (axes, fixed indices, row and column) at full zoom, and pin
   * its element.
   */
  async showFound({ view, index }) {
    if (!this.source || !view) return;
    if (view.axes) {
      this.slice.restore(view.axes, view.fixed);
      this.renderAxes();
      await this.applyView({ keepCamera: true });
    }
    this.focusElement(view.row, view.col);
    this.pinIndex(index);
  }

  /** The pinned element as a view element [r, c], when the view shows it. */
  pinnedCell() {
    const { pin, slice } = this;
    if (!pin) return null;
    const nd = pin.length;
    if (nd === 0) return [0, 0];
    if (nd === 1) return [0, pin[0]];
    if (slice.fixedOf(pin).join(',') !== slice.fixed.join(',')) return null;
    return [pin[slice.axes[0]], pin[slice.axes[1]]];
  }

  updateZoomLabel() {
    this.camera.showZoom(this.zoomLevelEl, this.zoomMagEl);
  }

  // ---------------------------------------------------------------- tiles and drawing

  /** What the tile loader should fetch: the visible region of the current view, or null. */
  wantedTile() {
    const reg = this.camera.region();
    if (!this.source || !reg) return null;
    return { endpoint: this.source.endpoint, params: { ...this.source.params, ...this.slice.params() }, reg };
  }

  tileArrived(tile) {
    this.failed = false;
    this.setMessage('');
    this.renormalise();
    this.updateBadge();
    this.draw();
    this.updateHover();
    if (this.onTile) this.onTile(tile.header);
  }

  renormalise() {
    const range = this.lockRange();
    syncSettingsControls(this, this.settings, range !== null);
    this.renderer.renormalise(this.tiles.layers, this.settings, range, this.camera.region());
  }

  updateBadge() {
    const newest = this.tiles.newest;
    this.badge.hidden = !newest || newest.exact;
  }

  scheduleDraw() {
    if (this.drawPending) return;
    this.drawPending = true;
    requestAnimationFrame(() => {
      this.drawPending = false;
      this.draw();
    });
  }

  draw() {
    const { source, camera, readout } = this;
    const shown = source && camera.W && !this.failed;
    const pinned = shown ? this.pinnedCell() : null;
    this.renderer.draw(shown ? {
      camera, layers: this.tiles.layers, settings: this.settings,
      boxes: this.slice.chunkBoxes(source.chunks), hotChunk: readout.hotChunk, hoverBlock: readout.block, pinned,
    } : null);
    const hovered = readout.block ? [readout.block.r0, readout.block.c0] : null;
    this.rulers.draw(shown ? camera : null, { hover: hovered, pin: pinned });
  }

  /** Work out what is under the cursor and write the readout (and tell the inspector). */
  updateHover() {
    this.readout.update({ source: this.source, camera: this.camera, slice: this.slice, tiles: this.tiles });
  }

  // ---------------------------------------------------------------- messages

  setMessage(text, { error = false } = {}) {
    this.messageEl.classList.toggle('error', error);
    this.messageEl.textContent = text;
  }

  /** Show a failed request: the canvas is cleared, so no earlier image stands under the error. */
  showError(err) {
    const status = err.status ? ` (HTTP ${err.status})` : '';
    this.failed = true;
    this.tiles.clear();
    this.renormalise();
    this.readout.clear();
    this.draw();
    this.updateBadge();
    this.updateZoomLabel();
    this.setMessage(`Could not load the tile${status}: ${err.message}`, { error: true });
  }

  /** A snapshot for tests and for the URL. */
  snapshot() {
    const { camera, slice, tiles } = this;
    const [sy, sx] = camera.W ? camera.steps() : [0, 0];
    const newest = tiles.newest;
    return {
      viewShape: [camera.H, camera.W], zoom: camera.z, x0: camera.x0, y0: camera.y0, step: [sy, sx],
      scale: camera.W ? [camera.scaleY(), camera.scaleX()] : null, atFit: camera.atFit,
      axes: slice.axes, fixed: slice.fixed, approximate: newest ? !newest.exact : null,
      tiles: tiles.layers.map((t) => ({ rows: t.header.rows, cols: t.header.cols, step: t.header.step, exact: t.exact,
        nonfinite: t.header.nonfinite_cells || 0, complete: Boolean(t.header.nonfinite_complete) })),
      settings: { ...this.settings }, range: this.range, pin: this.pin,
      visible: camera.visible(),
    };
  }
}
