// The Matrix/Heatmap view: a canvas showing any tensor as a 2-D view (1-D as a strip, N-D by
// choosing two axes and fixing the rest), with pan and zoom from the whole tensor down to single
// elements. This class composes the parts and keeps them in step:
//   camera.js    the view slice of the tensor and the zoom/pan arithmetic
//   tiles.js     tile requests, the loaded tiles, cancellation
//   render.js    colour mapping and drawing onto the canvas, the legend
//   pointer.js   drag, wheel and double-click on the canvas; the hover readout
//   controls.js  the toolbar: settings, zoom buttons, axes choice
// Keyboard shortcuts are app.js's, which calls zoomBy, fit, zoomOneToOne, panBy and cycle.

import { Camera, ViewSlice } from './camera.js';
import { bindSettingsControls, renderAxesControls, syncSettingsControls } from './controls.js';
import { HoverReadout, attachPointer } from './pointer.js';
import { Renderer } from './render.js';
import { TileLoader, probeViewShape } from './tiles.js';

export class Heatmap {
  constructor(parts) {
    Object.assign(this, parts);  // canvas, wrap, buttons, labels, onHover (see app.js)
    this.settings = { agg: 'absmax', cmap: 'viridis', norm: 'linear', clip: 1 };
    this.source = null;
    this.failed = false;  // the last request failed: draw nothing until a tile arrives
    this.slice = new ViewSlice();
    this.camera = new Camera(this.canvas);
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
    });
    new ResizeObserver(() => this.resize()).observe(this.wrap);
    this.resize();
  }

  // ---------------------------------------------------------------- settings

  /** Change display settings: recolours what is loaded, never requests anything. */
  set(changes) {
    Object.assign(this.settings, changes);
    syncSettingsControls(this, this.settings);
    this.renormalise();
    this.draw();
    this.updateHover();
  }

  cycle(key, names) {
    const i = names.indexOf(this.settings[key]);
    this.set({ [key]: names[(i + 1) % names.length] });
  }

  // ---------------------------------------------------------------- source and view

  /**
   * Show a tensor. source: {tensorKey, endpoint, params, dims, chunks, probe, indexOffset, title}
   * or null. params are the fixed query parameters (name, rank, kind); probe asks the server for
   * the view shape (needed for local(rank) views, whose shape only the server knows).
   */
  async setSource(source) {
    const sameTensor = this.source && source && this.source.tensorKey === source.tensorKey
      && JSON.stringify(this.source.dims) === JSON.stringify(source.dims);
    this.source = source;
    this.failed = false;
    this.tiles.clear();
    this.renormalise();  // the legend goes with the tiles
    this.readout.reset();
    this.setMessage('');
    if (!source) {
      this.camera.H = this.camera.W = 0;
      this.renderAxes();
      this.draw();
      this.updateZoomLabel();
      this.updateBadge();
      this.readout.clear();
      return;
    }
    if (!sameTensor) this.slice.reset(source.dims);
    this.renderAxes();
    await this.applyView({ keepCamera: sameTensor });
  }

  async applyView({ keepCamera = false } = {}) {
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
    if (!keepCamera || changed || !camera.fitted) this.fit({ fetch: false });
    this.draw();
    this.tiles.fetchVisible();
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

  // ---------------------------------------------------------------- camera

  resize() {
    const { camera, wrap } = this;
    const w = Math.max(1, Math.round(wrap.clientWidth * camera.dpr));
    const h = Math.max(1, Math.round(wrap.clientHeight * camera.dpr));
    if (!camera.resize(w, h)) return;
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

  afterCamera(fetch) {
    this.updateZoomLabel();
    this.scheduleDraw();
    this.updateHover();
    if (fetch) this.tiles.schedule();
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
    this.renderer.renormalise(this.tiles.layers, this.settings, this.tiles.generation);
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
    this.renderer.draw(source && camera.W && !this.failed ? {
      camera, layers: this.tiles.layers, settings: this.settings,
      boxes: this.slice.chunkBoxes(source.chunks), hotChunk: readout.hotChunk, hoverBlock: readout.block,
    } : null);
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
      axes: slice.axes, fixed: slice.fixed, approximate: newest ? !newest.exact : null,
      tiles: tiles.layers.map((t) => ({ rows: t.header.rows, cols: t.header.cols, step: t.header.step, exact: t.exact })),
      settings: { ...this.settings },
    };
  }
}
