// The Matrix/Heatmap view: a canvas showing any tensor as a 2-D view (1-D as a strip, N-D by
// choosing two axes and fixing the rest), with pan and zoom from the whole tensor down to single
// elements.
//
// Camera. Each axis has its own scale in device pixels per element: scale = max(z, fit), where fit
// stretches that axis to fill the canvas (capped at MAX_CELL) and z is the zoom. Zoomed out, the
// tensor fills the canvas like imshow(aspect="auto"); zoomed in past both fits, cells are square.
// A 30522×384 embedding is therefore readable at once, and a 1-D tensor is a strip.
//
// Tiles. For the visible region we ask for a tile at the canvas pixel size, snapped to the step
// grid so that small pans reuse cached tiles: first exact=0 (a strided sample, drawn at once with
// the "approximate" badge), then exact=1 replaces it. Older tiles stay underneath while new ones
// load, so panning never flashes blank.

import { getTile } from './api.js';
import { COLORMAPS, COLORMAP_LABELS, NORMALISATIONS, drawColorbar, makeNormaliser, paint, rgbOf } from './colormaps.js';
import { cell as fmtCell, int, value as fmtValue } from './format.js';

const MAX_CELL_CSS = 64;  // the largest cell, CSS pixels per element: "full zoom"
const TEXT_MIN_CELL_CSS = 34;  // cells at least this wide get their value written in them
const KEEP_TILES = 4;

export class Heatmap {
  constructor(parts) {
    Object.assign(this, parts);  // canvas, wrap, buttons, labels (see app.js)
    this.ctx = this.canvas.getContext('2d');
    this.settings = { agg: 'absmax', cmap: 'viridis', norm: 'linear', clip: 1 };
    this.source = null;
    this.layers = [];
    this.seq = 0;
    this.inflight = null;
    this.hover = null;
    this.hotChunk = -1;
    this.dpr = Math.min(2, window.devicePixelRatio || 1);
    this.H = 0;
    this.W = 0;
    this.z = 1;
    this.x0 = 0;
    this.y0 = 0;
    this.fitted = false;
    this.setupControls();
    this.setupPointer();
    new ResizeObserver(() => this.resize()).observe(this.wrap);
    this.resize();
  }

  // ---------------------------------------------------------------- controls

  setupControls() {
    for (const [name, label] of Object.entries(COLORMAP_LABELS)) this.cmapSelect.append(new Option(label, name));
    for (const [name, label] of Object.entries(NORMALISATIONS)) this.normSelect.append(new Option(label, name));
    this.syncControls();
    this.aggSelect.addEventListener('change', () => this.set({ agg: this.aggSelect.value }));
    this.cmapSelect.addEventListener('change', () => this.set({ cmap: this.cmapSelect.value }));
    this.normSelect.addEventListener('change', () => this.set({ norm: this.normSelect.value }));
    this.clipInput.addEventListener('input', () => {
      const v = Number(this.clipInput.value);
      if (v >= 0 && v < 50) this.set({ clip: v });
    });
    this.zoomInButton.addEventListener('click', () => this.zoomBy(2));
    this.zoomOutButton.addEventListener('click', () => this.zoomBy(0.5));
    this.zoomFitButton.addEventListener('click', () => this.fit());
  }

  syncControls() {
    this.aggSelect.value = this.settings.agg;
    this.cmapSelect.value = this.settings.cmap;
    this.normSelect.value = this.settings.norm;
    this.clipInput.value = this.settings.clip;
    this.clipWrap.hidden = this.settings.norm !== 'clip';
  }

  /** Change display settings: recolours what is loaded, never requests anything. */
  set(changes) {
    Object.assign(this.settings, changes);
    this.syncControls();
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
   * Show a tensor. source: {key, endpoint, params, dims, chunks, probe, title} or null.
   * params are the fixed query parameters (name, rank, kind); probe asks the server for the view
   * shape (needed for local(rank) views, whose shape only the server knows).
   */
  async setSource(source) {
    const sameTensor = this.source && source && this.source.tensorKey === source.tensorKey
      && JSON.stringify(this.source.dims) === JSON.stringify(source.dims);
    this.source = source;
    this.abortInflight();
    this.layers = [];
    this.hover = null;
    this.hotChunk = -1;
    this.setMessage('');
    if (!source) {
      this.H = this.W = 0;
      this.renderAxesControls();
      this.draw();
      this.updateZoomLabel();
      this.updateBadge();
      this.hoverEl.textContent = '\u00a0';
      return;
    }
    if (!sameTensor) {
      const nd = source.dims.length;
      this.axes = nd >= 2 ? [nd - 2, nd - 1] : [];
      this.fixed = new Array(Math.max(0, nd - 2)).fill(0);
    }
    this.renderAxesControls();
    await this.applyView({ keepCamera: sameTensor });
  }

  /** View parameters of the current axes choice, as the tile endpoint takes them. */
  viewParams() {
    const nd = this.source.dims.length;
    if (nd < 2) return {};
    const params = {};
    const [ay, ax] = this.axes;
    if (nd > 2 || ay !== nd - 2 || ax !== nd - 1) params.axes = `${ay},${ax}`;
    if (nd > 2) params.fixed = this.fixed.join(',');
    return params;
  }

  /** The view shape from the tensor's dims and the chosen axes. */
  localViewShape() {
    const d = this.source.dims;
    if (d.length === 0) return [1, 1];
    if (d.length === 1) return [1, d[0]];
    return [d[this.axes[0]], d[this.axes[1]]];
  }

  async applyView({ keepCamera = false } = {}) {
    const source = this.source;
    this.abortInflight();
    this.layers = [];
    const seq = ++this.seq;
    let [H, W] = this.localViewShape();
    if (source.probe) {
      try {
        const probe = await getTile(source.endpoint, { ...source.params, ...this.viewParams(), r0: 0, r1: 1, c0: 0, c1: 1, h: 1, w: 1, exact: 0 });
        [H, W] = probe.header.view_shape;
      } catch (err) {
        if (seq === this.seq) this.showError(err);
        return;
      }
      if (seq !== this.seq) return;
    }
    const changed = H !== this.H || W !== this.W;
    this.H = H;
    this.W = W;
    if (H === 0 || W === 0) {
      this.setMessage('empty tensor: no elements to draw');
      this.draw();
      return;
    }
    if (!keepCamera || changed || !this.fitted) this.fit({ fetch: false });
    this.draw();
    this.fetchVisible();
  }

  renderAxesControls() {
    const box = this.axesBox;
    box.replaceChildren();
    if (!this.source || this.source.dims.length < 2) return;
    const dims = this.source.dims;
    const nd = dims.length;
    const dimSelect = (which) => {
      const select = document.createElement('select');
      select.dataset.testid = which === 0 ? 'axis-rows' : 'axis-cols';
      dims.forEach((n, d) => select.append(new Option(`d${d} (${n})`, d)));
      select.value = this.axes[which];
      select.addEventListener('change', () => {
        const d = Number(select.value);
        const other = 1 - which;
        if (this.axes[other] === d) this.axes[other] = this.axes[which];
        this.axes[which] = d;
        this.fixed = new Array(nd - 2).fill(0);
        this.renderAxesControls();
        this.applyView();
      });
      return select;
    };
    const rows = document.createElement('label');
    rows.append('rows', dimSelect(0));
    const cols = document.createElement('label');
    cols.append('cols', dimSelect(1));
    box.append(rows, cols);
    let k = 0;
    for (let d = 0; d < nd; d++) {
      if (this.axes.includes(d)) continue;
      const index = k++;
      const label = document.createElement('label');
      label.title = `index along dimension ${d} (0..${dims[d] - 1})`;
      const input = document.createElement('input');
      input.type = 'number';
      input.min = 0;
      input.max = Math.max(0, dims[d] - 1);
      input.value = this.fixed[index];
      input.dataset.testid = `fixed-${d}`;
      input.addEventListener('change', () => {
        const v = Math.max(0, Math.min(dims[d] - 1, Math.floor(Number(input.value) || 0)));
        input.value = v;
        this.fixed[index] = v;
        this.applyView({ keepCamera: true });
      });
      label.append(`d${d}=`, input);
      box.append(label);
    }
  }

  /** Full tensor index of view element (r, c). */
  tensorIndex(r, c) {
    const nd = this.source.dims.length;
    if (nd === 0) return [];
    if (nd === 1) return [c];
    const index = [];
    let k = 0;
    for (let d = 0; d < nd; d++) {
      if (d === this.axes[0]) index.push(r);
      else if (d === this.axes[1]) index.push(c);
      else index.push(this.fixed[k++]);
    }
    return index;
  }

  // ---------------------------------------------------------------- camera

  resize() {
    const w = Math.max(1, Math.round(this.wrap.clientWidth * this.dpr));
    const h = Math.max(1, Math.round(this.wrap.clientHeight * this.dpr));
    if (w === this.canvas.width && h === this.canvas.height) return;
    const centre = this.W ? [this.x0 + this.canvas.width / 2 / this.scaleX(), this.y0 + this.canvas.height / 2 / this.scaleY()] : null;
    this.canvas.width = w;
    this.canvas.height = h;
    if (centre && this.atFit) {
      this.fit();
    } else if (centre) {
      this.z = Math.max(this.zMin(), Math.min(this.zMax(), this.z));
      this.x0 = centre[0] - w / 2 / this.scaleX();
      this.y0 = centre[1] - h / 2 / this.scaleY();
      this.clamp();
      this.scheduleFetch();
    }
    this.draw();
  }

  get maxCell() { return MAX_CELL_CSS * this.dpr; }
  fitX() { return Math.min(this.canvas.width / this.W, this.maxCell); }
  fitY() { return Math.min(this.canvas.height / this.H, this.maxCell); }
  zMin() { return Math.min(this.fitX(), this.fitY()); }
  zMax() { return Math.max(this.maxCell, this.fitX(), this.fitY()); }
  scaleX() { return Math.max(this.z, this.fitX()); }
  scaleY() { return Math.max(this.z, this.fitY()); }

  clamp() {
    const axis = (x0, n, scale, px) => {
      const span = px / scale;
      if (span >= n) return (n - span) / 2;
      return Math.min(Math.max(x0, 0), n - span);
    };
    this.x0 = axis(this.x0, this.W, this.scaleX(), this.canvas.width);
    this.y0 = axis(this.y0, this.H, this.scaleY(), this.canvas.height);
  }

  fit({ fetch = true } = {}) {
    if (!this.W) return;
    this.z = this.zMin();
    this.x0 = 0;
    this.y0 = 0;
    this.clamp();
    this.fitted = true;
    this.atFit = true;  // a resize re-fits instead of keeping the centre
    this.afterCamera(fetch);
  }

  /** Zoom by a factor keeping the element under canvas point (px, py) in place. */
  zoomAt(px, py, factor) {
    if (!this.W) return;
    const ex = this.x0 + px / this.scaleX();
    const ey = this.y0 + py / this.scaleY();
    this.z = Math.max(this.zMin(), Math.min(this.zMax(), this.z * factor));
    this.atFit = this.z <= this.zMin();
    this.x0 = ex - px / this.scaleX();
    this.y0 = ey - py / this.scaleY();
    this.clamp();
    this.afterCamera(true);
  }

  zoomBy(factor) {
    this.zoomAt(this.canvas.width / 2, this.canvas.height / 2, factor);
  }

  /** One element per CSS pixel ("1:1"). */
  zoomOneToOne() {
    if (!this.W) return;
    this.zoomAt(this.canvas.width / 2, this.canvas.height / 2, this.dpr / this.z);
  }

  panBy(dx, dy) {
    if (!this.W) return;
    this.x0 -= dx / this.scaleX();
    this.y0 -= dy / this.scaleY();
    this.clamp();
    this.afterCamera(true);
  }

  /** Centre the view on view element (r, c) at full zoom. */
  focusElement(r, c) {
    if (!this.W) return;
    this.z = this.zMax();
    this.atFit = false;
    this.x0 = c + 0.5 - this.canvas.width / 2 / this.scaleX();
    this.y0 = r + 0.5 - this.canvas.height / 2 / this.scaleY();
    this.clamp();
    this.afterCamera(true);
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
    const fixed = index.filter((_, d) => !this.axes.includes(d));
    if (fixed.join(',') !== this.fixed.join(',')) {
      this.fixed = fixed;
      this.renderAxesControls();
      await this.applyView({ keepCamera: true });
    }
    this.focusElement(index[this.axes[0]], index[this.axes[1]]);
  }

  afterCamera(fetch) {
    this.updateZoomLabel();
    this.scheduleDraw();
    this.updateHover();
    if (fetch) this.scheduleFetch();
  }

  steps() {
    return [Math.max(1, Math.ceil(1 / this.scaleY() - 1e-9)), Math.max(1, Math.ceil(1 / this.scaleX() - 1e-9))];
  }

  updateZoomLabel() {
    if (!this.W) {
      this.zoomLevelEl.textContent = '–';
      this.zoomMagEl.textContent = '';
      return;
    }
    const [sy, sx] = this.steps();
    const n = Math.max(sy, sx);
    this.zoomLevelEl.textContent = `1:${n}`;
    this.zoomLevelEl.dataset.step = `${sy},${sx}`;
    this.zoomLevelEl.title = sy === sx ? `${n} element(s) per pixel` : `${sy} row(s) × ${sx} column(s) per pixel`;
    const cell = Math.min(this.scaleX(), this.scaleY()) / this.dpr;
    this.zoomMagEl.textContent = n === 1 && cell >= 2 ? `×${Math.round(cell)}` : '';
  }

  // ---------------------------------------------------------------- tiles

  /** The visible region snapped to the step grid, and the pixel size to ask for. */
  region() {
    if (!this.W) return null;
    const sX = this.scaleX();
    const sY = this.scaleY();
    const [stepY, stepX] = this.steps();
    let c0 = Math.max(0, Math.floor(this.x0));
    let c1 = Math.min(this.W, Math.ceil(this.x0 + this.canvas.width / sX));
    let r0 = Math.max(0, Math.floor(this.y0));
    let r1 = Math.min(this.H, Math.ceil(this.y0 + this.canvas.height / sY));
    if (c1 <= c0 || r1 <= r0) return null;
    c0 = Math.floor(c0 / stepX) * stepX;
    r0 = Math.floor(r0 / stepY) * stepY;
    c1 = Math.min(this.W, Math.ceil(c1 / stepX) * stepX);
    r1 = Math.min(this.H, Math.ceil(r1 / stepY) * stepY);
    return { r0, r1, c0, c1, h: Math.ceil((r1 - r0) / stepY), w: Math.ceil((c1 - c0) / stepX), stepY, stepX };
  }

  static covers(reg, want) {
    return reg.r0 <= want.r0 && reg.r1 >= want.r1 && reg.c0 <= want.c0 && reg.c1 >= want.c1
      && reg.stepY === want.stepY && reg.stepX === want.stepX;
  }

  scheduleFetch() {
    clearTimeout(this.fetchTimer);
    this.fetchTimer = setTimeout(() => this.fetchVisible(), 70);
  }

  abortInflight() {
    clearTimeout(this.fetchTimer);
    if (this.inflight) this.inflight.controller.abort();
    this.inflight = null;
  }

  async fetchVisible() {
    const source = this.source;
    const reg = this.region();
    if (!source || !reg) return;
    const covering = this.layers.filter((t) => Heatmap.covers(t.reg, reg));
    if (covering.some((t) => t.exact)) return;
    if (this.inflight && Heatmap.covers(this.inflight.reg, reg)) return;  // already on its way
    if (this.inflight) this.inflight.controller.abort();
    const controller = new AbortController();
    const seq = ++this.seq;
    this.inflight = { reg, controller, seq };
    const params = { ...source.params, ...this.viewParams(), r0: reg.r0, r1: reg.r1, c0: reg.c0, c1: reg.c1, h: reg.h, w: reg.w };
    try {
      if (!covering.length) {
        const approx = await getTile(source.endpoint, { ...params, exact: 0 }, { signal: controller.signal });
        if (seq !== this.seq) return;
        this.addTile(approx, reg);
        // At one element per pixel the sample is every element: the server marks it exact.
        if (!approx.header.approximate) return;
      }
      const exact = await getTile(source.endpoint, { ...params, exact: 1 }, { signal: controller.signal });
      if (seq !== this.seq) return;
      this.addTile(exact, reg);
    } catch (err) {
      if (err.name !== 'AbortError' && seq === this.seq) this.showError(err);
    } finally {
      if (this.inflight && this.inflight.seq === seq) this.inflight = null;
    }
  }

  addTile(tile, reg) {
    const [vh, vw] = tile.header.view_shape;
    if (vh !== this.H || vw !== this.W) {
      // The server knows the view better (local views, unusual ranks): adopt its shape and refit.
      this.H = vh;
      this.W = vw;
      this.layers = [];
      this.fit();
      return;
    }
    tile.reg = reg;
    tile.exact = !tile.header.approximate;
    if (tile.exact) this.layers = this.layers.filter((t) => !(t.reg === reg || (!t.exact && Heatmap.covers(reg, t.reg))));
    this.layers.push(tile);
    if (this.layers.length > KEEP_TILES) this.layers.splice(0, this.layers.length - KEEP_TILES);
    this.setMessage('');
    this.renormalise();
    this.updateBadge();
    this.draw();
    this.updateHover();
    if (this.onTile) this.onTile(tile.header);
  }

  /** The field a tile is drawn from: the chosen aggregation when the tile has it. */
  fieldOf(tile) {
    const { fields } = tile;
    if (fields[this.settings.agg]) return this.settings.agg;
    return fields.value ? 'value' : tile.header.fields[0];
  }

  renormalise() {
    const newest = this.layers[this.layers.length - 1];
    if (!newest) {
      this.normaliser = null;
      this.legendLo.textContent = this.legendHi.textContent = '';
      return;
    }
    this.normaliser = makeNormaliser(newest.fields[this.fieldOf(newest)], this.settings.norm, { clipPercent: this.settings.clip });
    this.normKey = `${this.seq}:${this.layers.length}:${this.fieldOf(newest)}:${this.settings.cmap}:${this.settings.norm}:${this.settings.clip}:${newest.reg.r0},${newest.reg.c0}`;
    const lut = COLORMAPS[this.settings.cmap];
    drawColorbar(this.colorbar, lut);
    const n = this.normaliser;
    this.legendLo.textContent = n.log ? `|x| ${fmtValue(n.lo, 3)}` : fmtValue(n.lo, 4);
    this.legendHi.textContent = fmtValue(n.hi, 4);
    this.colorbar.title = `${NORMALISATIONS[this.settings.norm]} · ${COLORMAP_LABELS[this.settings.cmap]}`;
  }

  paintTile(tile) {
    if (tile.paintKey === this.normKey && tile.image) return tile.image;
    const [rows, cols] = tile.header.shape;
    const image = tile.image || document.createElement('canvas');
    image.width = cols;
    image.height = rows;
    const ctx = image.getContext('2d');
    const data = ctx.createImageData(cols, rows);
    paint(tile.fields[this.fieldOf(tile)], data.data, this.normaliser, COLORMAPS[this.settings.cmap]);
    ctx.putImageData(data, 0, 0);
    tile.image = image;
    tile.paintKey = this.normKey;
    return image;
  }

  updateBadge() {
    const newest = this.layers[this.layers.length - 1];
    this.badge.hidden = !newest || newest.exact;
  }

  // ---------------------------------------------------------------- drawing

  scheduleDraw() {
    if (this.drawPending) return;
    this.drawPending = true;
    requestAnimationFrame(() => {
      this.drawPending = false;
      this.draw();
    });
  }

  draw() {
    const { ctx, canvas } = this;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = '#e8ebf0';
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    if (!this.source || !this.W) return;
    const sX = this.scaleX();
    const sY = this.scaleY();
    const X = (c) => (c - this.x0) * sX;
    const Y = (r) => (r - this.y0) * sY;
    ctx.fillStyle = '#ffffff';
    ctx.fillRect(X(0), Y(0), this.W * sX, this.H * sY);
    for (const tile of this.layers) this.drawTile(tile, X, Y, sX, sY);
    this.drawGridAndText(X, Y, sX, sY);
    this.drawChunks(X, Y, sX, sY);
    this.drawHover(X, Y, sX, sY);
    ctx.strokeStyle = 'rgba(28, 36, 48, 0.5)';
    ctx.lineWidth = this.dpr;
    ctx.strokeRect(X(0) - 0.5, Y(0) - 0.5, this.W * sX + 1, this.H * sY + 1);
  }

  drawTile(tile, X, Y, sX, sY) {
    if (!this.normaliser) return;
    const { ctx, canvas } = this;
    const [r0, r1] = tile.header.rows;
    const [c0, c1] = tile.header.cols;
    const [sy, sx] = tile.header.step;
    const [rows, cols] = tile.header.shape;
    // Only the tile pixels in view are drawn: a coarse tile zoomed far in would otherwise be
    // scaled to a canvas millions of pixels wide.
    const i0 = Math.max(0, Math.floor((this.y0 - r0) / sy));
    const i1 = Math.min(rows, Math.ceil((this.y0 + canvas.height / sY - r0) / sy));
    const j0 = Math.max(0, Math.floor((this.x0 - c0) / sx));
    const j1 = Math.min(cols, Math.ceil((this.x0 + canvas.width / sX - c0) / sx));
    if (i1 <= i0 || j1 <= j0) return;
    const image = this.paintTile(tile);
    ctx.save();
    ctx.beginPath();
    ctx.rect(X(c0), Y(r0), (c1 - c0) * sX, (r1 - r0) * sY);  // the last block may be cut short
    ctx.clip();
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(image, j0, i0, j1 - j0, i1 - i0,
      X(c0 + j0 * sx), Y(r0 + i0 * sy), (j1 - j0) * sx * sX, (i1 - i0) * sy * sY);
    ctx.restore();
  }

  /** Cell grid and value text at high zoom, from the newest element-level tile. */
  drawGridAndText(X, Y, sX, sY) {
    const { ctx, canvas, dpr } = this;
    const tile = [...this.layers].reverse().find((t) => t.header.step[0] === 1 && t.header.step[1] === 1);
    if (!tile || sX < 10 * dpr || sY < 10 * dpr) return;
    const [r0, r1] = tile.header.rows;
    const [c0, c1] = tile.header.cols;
    const ra = Math.max(r0, Math.floor(this.y0));
    const rb = Math.min(r1, Math.ceil(this.y0 + canvas.height / sY));
    const ca = Math.max(c0, Math.floor(this.x0));
    const cb = Math.min(c1, Math.ceil(this.x0 + canvas.width / sX));
    ctx.strokeStyle = 'rgba(255, 255, 255, 0.45)';
    ctx.lineWidth = 1;
    ctx.beginPath();
    for (let r = ra; r <= rb; r++) { ctx.moveTo(X(ca), Math.round(Y(r)) + 0.5); ctx.lineTo(X(cb), Math.round(Y(r)) + 0.5); }
    for (let c = ca; c <= cb; c++) { ctx.moveTo(Math.round(X(c)) + 0.5, Y(ra)); ctx.lineTo(Math.round(X(c)) + 0.5, Y(rb)); }
    ctx.stroke();
    if (sX < TEXT_MIN_CELL_CSS * dpr || sY < 14 * dpr) return;
    const values = tile.fields[this.fieldOf(tile)];
    const cols = tile.header.shape[1];
    const lut = COLORMAPS[this.settings.cmap];
    const size = Math.min(12 * dpr, sY * 0.42, sX / 5.2);
    ctx.font = `${size}px ui-monospace, Menlo, Consolas, monospace`;
    ctx.textAlign = 'center';
    ctx.textBaseline = 'middle';
    for (let r = ra; r < rb; r++) {
      for (let c = ca; c < cb; c++) {
        const v = values[(r - r0) * cols + (c - c0)];
        let light = false;
        if (!Number.isNaN(v)) {
          const [R, G, B] = rgbOf(this.normaliser.map(v), lut);
          light = 0.299 * R + 0.587 * G + 0.114 * B < 140;
        }
        ctx.fillStyle = light ? '#ffffff' : '#111111';
        ctx.fillText(fmtCell(v), X(c + 0.5), Y(r + 0.5));
      }
    }
  }

  /** Placement chunks as boxes on the logical view (full() only). */
  chunkBoxes() {
    const chunks = this.source && this.source.chunks;
    if (!chunks || chunks.length < 2) return [];
    const nd = this.source.dims.length;
    const boxes = [];
    chunks.forEach((chunk, i) => {
      const { offsets, shape } = chunk;
      if (nd === 0) return;
      if (nd === 1) {
        boxes.push({ i, r0: 0, r1: 1, c0: offsets[0], c1: offsets[0] + shape[0], chunk });
        return;
      }
      let k = 0;
      for (let d = 0; d < nd; d++) {
        if (this.axes.includes(d)) continue;
        const f = this.fixed[k++];
        if (f < offsets[d] || f >= offsets[d] + shape[d]) return;
      }
      const [ay, ax] = this.axes;
      boxes.push({ i, r0: offsets[ay], r1: offsets[ay] + shape[ay], c0: offsets[ax], c1: offsets[ax] + shape[ax], chunk });
    });
    return boxes.filter((b) => b.r1 > b.r0 && b.c1 > b.c0);
  }

  drawChunks(X, Y, sX, sY) {
    const { ctx, dpr } = this;
    const boxes = this.chunkBoxes();
    if (!boxes.length) return;
    ctx.save();
    ctx.lineWidth = dpr;
    ctx.font = `${11 * dpr}px system-ui, sans-serif`;
    ctx.textAlign = 'left';
    ctx.textBaseline = 'top';
    for (const b of boxes) {
      const x = X(b.c0);
      const y = Y(b.r0);
      const w = (b.c1 - b.c0) * sX;
      const h = (b.r1 - b.r0) * sY;
      const hot = b.i === this.hotChunk;
      if (hot) {
        ctx.fillStyle = 'rgba(255, 196, 0, 0.18)';
        ctx.fillRect(x, y, w, h);
      }
      ctx.setLineDash(hot ? [] : [5 * dpr, 4 * dpr]);
      ctx.strokeStyle = hot ? 'rgba(230, 140, 0, 0.95)' : 'rgba(20, 20, 20, 0.55)';
      ctx.strokeRect(x + 0.5, y + 0.5, w - 1, h - 1);
      if (w > 70 * dpr && h > 18 * dpr) {
        const label = `#${b.i} rank ${b.chunk.ranks.join(',') || '?'}`;
        ctx.fillStyle = 'rgba(255, 255, 255, 0.85)';
        const tw = ctx.measureText(label).width;
        ctx.fillRect(Math.max(x, 0) + 3 * dpr, Math.max(y, 0) + 3 * dpr, tw + 6 * dpr, 15 * dpr);
        ctx.fillStyle = '#222';
        ctx.fillText(label, Math.max(x, 0) + 6 * dpr, Math.max(y, 0) + 5 * dpr);
      }
    }
    ctx.restore();
  }

  drawHover(X, Y, sX, sY) {
    const h = this.hoverInfo;
    if (!h) return;
    const { ctx, dpr } = this;
    ctx.save();
    ctx.lineWidth = 1.5 * dpr;
    ctx.strokeStyle = '#ff3b30';
    const x = X(h.block.c0);
    const y = Y(h.block.r0);
    const w = Math.max(2 * dpr, (h.block.c1 - h.block.c0) * sX);
    const hh = Math.max(2 * dpr, (h.block.r1 - h.block.r0) * sY);
    ctx.strokeRect(x, y, w, hh);
    ctx.restore();
  }

  // ---------------------------------------------------------------- pointer

  setupPointer() {
    const c = this.canvas;
    let drag = null;
    c.addEventListener('pointerdown', (e) => {
      if (e.button !== 0) return;
      c.focus({ preventScroll: true });
      drag = { x: e.clientX, y: e.clientY, moved: false };
      c.setPointerCapture(e.pointerId);
    });
    c.addEventListener('pointermove', (e) => {
      if (drag) {
        const dx = e.clientX - drag.x;
        const dy = e.clientY - drag.y;
        if (Math.abs(dx) + Math.abs(dy) > 0) {
          drag.moved = true;
          c.classList.add('dragging');
          drag.x = e.clientX;
          drag.y = e.clientY;
          this.panBy(dx * this.dpr, dy * this.dpr);
        }
      }
      this.hover = { px: e.offsetX * this.dpr, py: e.offsetY * this.dpr };
      this.updateHover();
      this.scheduleDraw();
    });
    const end = (e) => {
      if (drag) c.releasePointerCapture(e.pointerId);
      drag = null;
      c.classList.remove('dragging');
    };
    c.addEventListener('pointerup', end);
    c.addEventListener('pointercancel', end);
    c.addEventListener('pointerleave', () => {
      if (drag) return;
      this.hover = null;
      this.updateHover();
      this.scheduleDraw();
    });
    c.addEventListener('wheel', (e) => {
      if (!this.W) return;
      e.preventDefault();
      const unit = e.deltaMode === 1 ? 0.05 : e.deltaMode === 2 ? 1 : 0.002;
      this.zoomAt(e.offsetX * this.dpr, e.offsetY * this.dpr, Math.exp(-e.deltaY * unit));
    }, { passive: false });
    c.addEventListener('dblclick', (e) => this.zoomAt(e.offsetX * this.dpr, e.offsetY * this.dpr, e.shiftKey ? 0.5 : 2));
  }

  /** Work out what is under the cursor and write the readout (and tell the inspector). */
  updateHover() {
    const el = this.hoverEl;
    const previousChunk = this.hotChunk;
    this.hoverInfo = null;
    if (!this.hover || !this.W || !this.source) {
      el.textContent = '\u00a0';
      delete el.dataset.value;
      this.setHotChunk(-1, previousChunk, null);
      return;
    }
    const r = Math.floor(this.y0 + this.hover.py / this.scaleY());
    const c = Math.floor(this.x0 + this.hover.px / this.scaleX());
    if (r < 0 || c < 0 || r >= this.H || c >= this.W) {
      el.textContent = '\u00a0';
      delete el.dataset.value;
      this.setHotChunk(-1, previousChunk, null);
      return;
    }
    const index = this.tensorIndex(r, c);
    el.dataset.row = r;
    el.dataset.col = c;
    el.dataset.index = index.join(',');
    const offset = this.source.indexOffset;
    const at = offset
      ? `[${index.join(', ')}] (global [${index.map((v, d) => v + offset[d]).join(', ')}])`
      : `[${index.join(', ')}]`;
    const tile = [...this.layers].reverse().find((t) =>
      t.header.rows[0] <= r && r < t.header.rows[1] && t.header.cols[0] <= c && c < t.header.cols[1]);
    if (!tile) {
      el.textContent = `${at}  loading…`;
      delete el.dataset.value;
    } else {
      const [sy, sx] = tile.header.step;
      const [rows0, rows1] = tile.header.rows;
      const [cols0, cols1] = tile.header.cols;
      const i = Math.floor((r - rows0) / sy);
      const j = Math.floor((c - cols0) / sx);
      const k = i * tile.header.shape[1] + j;
      const block = {
        r0: rows0 + i * sy, r1: Math.min(rows0 + (i + 1) * sy, rows1),
        c0: cols0 + j * sx, c1: Math.min(cols0 + (j + 1) * sx, cols1),
      };
      this.hoverInfo = { r, c, block };
      el.dataset.exact = tile.exact ? '1' : '0';
      if (sy === 1 && sx === 1) {
        const v = tile.fields.value ? tile.fields.value[k] : tile.fields[tile.header.fields[0]][k];
        el.dataset.value = String(v);
        el.textContent = `${at} = ${fmtValue(v, 7)}`;
      } else if (tile.exact) {
        const f = tile.fields;
        delete el.dataset.value;
        const n = (block.r1 - block.r0) * (block.c1 - block.c0);
        const stat = (name) => (f[name] ? fmtValue(f[name][k], 4) : '–');
        el.textContent = `${this.blockLabel(block)} (${int(n)} el.)  ` +
          `min ${stat('min')}  max ${stat('max')}  mean ${stat('mean')}  |max| ${stat('absmax')}`;
      } else {
        const v = tile.fields.value[k];
        delete el.dataset.value;
        el.textContent = `${at} ≈ ${fmtValue(v, 5)}  (sampled from a ${sy}×${sx} block; exact loading…)`;
      }
    }
    const chunk = this.chunkBoxes().find((b) => b.r0 <= r && r < b.r1 && b.c0 <= c && c < b.c1);
    this.setHotChunk(chunk ? chunk.i : -1, previousChunk, index);
  }

  /** A pixel block in the tensor's own index notation: [16422:16464, 188] or [2, 0:8, 16:24]. */
  blockLabel(block) {
    const span = (a, b) => (b - a === 1 ? `${a}` : `${a}:${b}`);
    const nd = this.source.dims.length;
    if (nd <= 1) return `[${span(block.c0, block.c1)}]`;
    const parts = [];
    let k = 0;
    for (let d = 0; d < nd; d++) {
      if (d === this.axes[0]) parts.push(span(block.r0, block.r1));
      else if (d === this.axes[1]) parts.push(span(block.c0, block.c1));
      else parts.push(String(this.fixed[k++]));
    }
    return `[${parts.join(', ')}]`;
  }

  setHotChunk(i, previous, index) {
    this.hotChunk = i;
    if (this.onHover && (i !== previous || index === null)) this.onHover({ chunk: i, index });
  }

  // ---------------------------------------------------------------- messages

  setMessage(text, { error = false } = {}) {
    this.messageEl.classList.toggle('error', error);
    this.messageEl.textContent = text;
  }

  showError(err) {
    const status = err.status ? ` (HTTP ${err.status})` : '';
    this.setMessage(`Could not load the tile${status}: ${err.message}`, { error: true });
    this.updateBadge();
  }

  /** A snapshot for tests and for the URL. */
  snapshot() {
    const [sy, sx] = this.W ? this.steps() : [0, 0];
    const newest = this.layers[this.layers.length - 1];
    return {
      viewShape: [this.H, this.W], zoom: this.z, x0: this.x0, y0: this.y0, step: [sy, sx],
      axes: this.axes, fixed: this.fixed, approximate: newest ? !newest.exact : null,
      tiles: this.layers.map((t) => ({ rows: t.header.rows, cols: t.header.cols, step: t.header.step, exact: t.exact })),
      settings: { ...this.settings },
    };
  }
}
