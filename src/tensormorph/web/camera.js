// Camera and view arithmetic for the heatmap: which dimensions of the tensor form the 2-D view, and
// which part of that view the canvas shows. No drawing and no requests happen here.
//
// Camera. Each axis has its own scale in device pixels per element: scale = max(z, fit), where fit
// stretches that axis to fill the canvas (capped at MAX_CELL) and z is the zoom. Zoomed out, the
// tensor fills the canvas like imshow(aspect="auto"); zoomed in past both fits, cells are square.
// A 30522×384 embedding is therefore readable at once, and a 1-D tensor is a strip.

const MAX_CELL_CSS = 64;  // the largest cell, CSS pixels per element: "full zoom"

/** Which two dimensions of an N-D tensor are shown (rows, cols) and where the others are fixed. */
export class ViewSlice {
  constructor() {
    this.dims = [];
    this.axes = [];
    this.fixed = [];
  }

  /** Show the last two dimensions, the others fixed at 0. */
  reset(dims) {
    const nd = dims.length;
    this.dims = dims;
    this.axes = nd >= 2 ? [nd - 2, nd - 1] : [];
    this.fixed = new Array(Math.max(0, nd - 2)).fill(0);
  }

  /** Take axes and fixed indices from a link where they fit these dims (else keep the current ones). */
  restore(axes, fixed) {
    const nd = this.dims.length;
    if (nd < 2) return;
    if (axes && axes.length === 2 && axes[0] !== axes[1] && axes.every((d) => d < nd)) this.axes = [...axes];
    const others = this.dims.filter((_, d) => !this.axes.includes(d));
    if (fixed && fixed.length === nd - 2 && fixed.every((v, k) => v < others[k])) this.fixed = [...fixed];
    else if (axes) this.fixed = new Array(nd - 2).fill(0);
  }

  /** Show dimension d along `which` (0 rows, 1 cols), swapping if the other axis had it. */
  chooseAxis(which, d) {
    const other = 1 - which;
    if (this.axes[other] === d) this.axes[other] = this.axes[which];
    this.axes[which] = d;
    this.fixed = new Array(this.dims.length - 2).fill(0);
  }

  /** View parameters of the current axes choice, as the tile endpoint takes them. */
  params() {
    const nd = this.dims.length;
    if (nd < 2) return {};
    const params = {};
    const [ay, ax] = this.axes;
    if (nd > 2 || ay !== nd - 2 || ax !== nd - 1) params.axes = `${ay},${ax}`;
    if (nd > 2) params.fixed = this.fixed.join(',');
    return params;
  }

  /** The view shape from the tensor's dims and the chosen axes. */
  shape() {
    const d = this.dims;
    if (d.length === 0) return [1, 1];
    if (d.length === 1) return [1, d[0]];
    return [d[this.axes[0]], d[this.axes[1]]];
  }

  /** Full tensor index of view element (r, c). */
  tensorIndex(r, c) {
    const nd = this.dims.length;
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

  /** The fixed indices a full tensor index implies for the non-displayed dimensions. */
  fixedOf(index) {
    return index.filter((_, d) => !this.axes.includes(d));
  }

  /** A pixel block in the tensor's own index notation: [16422:16464, 188] or [2, 0:8, 16:24]. */
  blockLabel(block) {
    const span = (a, b) => (b - a === 1 ? `${a}` : `${a}:${b}`);
    const nd = this.dims.length;
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

  /** Placement chunks as boxes on the view (full() only): those the fixed indices cut through. */
  chunkBoxes(chunks) {
    if (!chunks || chunks.length < 2) return [];
    const nd = this.dims.length;
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
}

/**
 * Zoom and pan over an H×W view drawn on `canvas`. Moves return false when there is no view, so
 * the caller knows not to redraw or fetch.
 */
export class Camera {
  constructor(canvas) {
    this.canvas = canvas;
    this.dpr = Math.min(2, window.devicePixelRatio || 1);
    this.H = 0;
    this.W = 0;
    this.z = 1;
    this.x0 = 0;
    this.y0 = 0;
    this.fitted = false;  // fitted at least once, so there is a camera worth keeping
    this.atFit = false;  // a resize re-fits instead of keeping the centre
  }

  get maxCell() { return MAX_CELL_CSS * this.dpr; }
  fitX() { return Math.min(this.canvas.width / this.W, this.maxCell); }
  fitY() { return Math.min(this.canvas.height / this.H, this.maxCell); }
  zMin() { return Math.min(this.fitX(), this.fitY()); }
  zMax() { return Math.max(this.maxCell, this.fitX(), this.fitY()); }
  scaleX() { return Math.max(this.z, this.fitX()); }
  scaleY() { return Math.max(this.z, this.fitY()); }

  /** Resize the canvas to w×h device pixels, keeping the centre in place; false when unchanged. */
  resize(w, h) {
    const { canvas } = this;
    if (w === canvas.width && h === canvas.height) return false;
    const centre = this.W ? [this.x0 + canvas.width / 2 / this.scaleX(), this.y0 + canvas.height / 2 / this.scaleY()] : null;
    canvas.width = w;
    canvas.height = h;
    if (centre && !this.atFit) {
      this.z = Math.max(this.zMin(), Math.min(this.zMax(), this.z));
      this.x0 = centre[0] - w / 2 / this.scaleX();
      this.y0 = centre[1] - h / 2 / this.scaleY();
      this.clamp();
    }
    return true;
  }

  /** Keep the view on the canvas; centre an axis that is shorter than the canvas. */
  clamp() {
    const axis = (x0, n, scale, px) => {
      const span = px / scale;
      if (span >= n) return (n - span) / 2;
      return Math.min(Math.max(x0, 0), n - span);
    };
    this.x0 = axis(this.x0, this.W, this.scaleX(), this.canvas.width);
    this.y0 = axis(this.y0, this.H, this.scaleY(), this.canvas.height);
  }

  fit() {
    if (!this.W) return false;
    this.z = this.zMin();
    this.x0 = 0;
    this.y0 = 0;
    this.clamp();
    this.fitted = true;
    this.atFit = true;
    return true;
  }

  /** Zoom by a factor keeping the element under canvas point (px, py) in place. */
  zoomAt(px, py, factor) {
    if (!this.W) return false;
    const ex = this.x0 + px / this.scaleX();
    const ey = this.y0 + py / this.scaleY();
    this.z = Math.max(this.zMin(), Math.min(this.zMax(), this.z * factor));
    this.atFit = this.z <= this.zMin();
    this.x0 = ex - px / this.scaleX();
    this.y0 = ey - py / this.scaleY();
    this.clamp();
    return true;
  }

  panBy(dx, dy) {
    if (!this.W) return false;
    this.x0 -= dx / this.scaleX();
    this.y0 -= dy / this.scaleY();
    this.clamp();
    return true;
  }

  /** Centre the view on view element (r, c) at full zoom. */
  focusElement(r, c) {
    if (!this.W) return false;
    this.z = this.zMax();
    this.atFit = false;
    this.x0 = c + 0.5 - this.canvas.width / 2 / this.scaleX();
    this.y0 = r + 0.5 - this.canvas.height / 2 / this.scaleY();
    this.clamp();
    return true;
  }

  /** The view element [row, col] (fractional) at the canvas centre. */
  centre() {
    return [this.y0 + this.canvas.height / 2 / this.scaleY(), this.x0 + this.canvas.width / 2 / this.scaleX()];
  }

  /** Zoom to `zoomCss` CSS pixels per element (clamped) centred on view element (row, col): a link's view. */
  setView(zoomCss, row, col) {
    if (!this.W) return false;
    this.z = Math.max(this.zMin(), Math.min(this.zMax(), zoomCss * this.dpr));
    this.atFit = this.z <= this.zMin();
    this.fitted = true;
    this.x0 = col - this.canvas.width / 2 / this.scaleX();
    this.y0 = row - this.canvas.height / 2 / this.scaleY();
    this.clamp();
    return true;
  }

  /** The visible part of the view, [r0, r1) × [c0, c1) in elements (not snapped to the step grid). */
  visible() {
    if (!this.W) return null;
    const r0 = Math.max(0, Math.floor(this.y0));
    const c0 = Math.max(0, Math.floor(this.x0));
    const r1 = Math.min(this.H, Math.ceil(this.y0 + this.canvas.height / this.scaleY() - 1e-9));
    const c1 = Math.min(this.W, Math.ceil(this.x0 + this.canvas.width / this.scaleX() - 1e-9));
    return r1 > r0 && c1 > c0 ? { r0, r1, c0, c1 } : null;
  }

  /** The view element (r, c) under canvas point (px, py); it may lie outside the view. */
  elementAt(px, py) {
    return [Math.floor(this.y0 + py / this.scaleY()), Math.floor(this.x0 + px / this.scaleX())];
  }

  /** Elements per pixel along [rows, cols]. */
  steps() {
    return [Math.max(1, Math.ceil(1 / this.scaleY() - 1e-9)), Math.max(1, Math.ceil(1 / this.scaleX() - 1e-9))];
  }

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

  /** Write the zoom level ("1:n", and "×k" for cells k CSS pixels wide) into the zoom box. */
  showZoom(levelEl, magEl) {
    if (!this.W) {
      levelEl.textContent = '–';
      magEl.textContent = '';
      return;
    }
    const [sy, sx] = this.steps();
    const n = Math.max(sy, sx);
    levelEl.textContent = `1:${n}`;
    levelEl.dataset.step = `${sy},${sx}`;
    levelEl.title = sy === sx ? `${n} element(s) per pixel` : `${sy} row(s) × ${sx} column(s) per pixel`;
    const cell = Math.min(this.scaleX(), this.scaleY()) / this.dpr;
    magEl.textContent = n === 1 && cell >= 2 ? `×${Math.round(cell)}` : '';
  }
}
