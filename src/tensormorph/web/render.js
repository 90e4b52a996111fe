// Drawing for the heatmap: colour-maps tiles into images, draws them through the camera, and overlays
// the cell grid with values, the placement chunks and the hovered block. Also keeps the legend.

import { COLORMAPS, COLORMAP_LABELS, NORMALISATIONS, drawColorbar, flagRgb, makeNormaliser, paint, rgbOf } from './colormaps.js';
import { cell as fmtCell, value as fmtValue } from './format.js';

const TEXT_MIN_CELL_CSS = 34;  // cells at least this wide get their value written in them
const PIN_MIN_CSS = 9;  // the pinned element's frame is never smaller than this
const MARK_MAX_CELLS = 256;  // up to this many non-finite pixels in view get a ring, so that one pixel is seen
const MARK_RADIUS_CSS = 7;

/** The block summary in force: 'auto' is signed (mean) on a diverging map, abs-max on the others. */
export function resolveAgg(settings) {
  if (settings.agg !== 'auto') return settings.agg;
  return settings.cmap === 'diverging' ? 'mean' : 'absmax';
}

/**
 * The values a tile is drawn with under block summary `agg`, in the summary's own terms whatever the
 * tile holds: an exact tile's field, or single values (a strided sample, or one element per pixel),
 * taken as |x| under abs-max. So the approximate and the exact tile of a block mean the same thing.
 */
export function valuesOf(tile, agg) {
  const { fields } = tile;
  if (fields[agg]) return fields[agg];
  const values = fields.value || fields[tile.header.fields[0]];
  if (agg !== 'absmax') return values;
  if (!tile.absValues) tile.absValues = values.map(Math.abs);
  return tile.absValues;
}

/** The values of `tile` (one per pixel) that lie in `region` {r0, r1, c0, c1}; all of them when none do. */
export function within(tile, values, region) {
  const [r0] = tile.header.rows;
  const [c0] = tile.header.cols;
  const [sy, sx] = tile.header.step;
  const [rows, cols] = tile.header.shape;
  const i0 = Math.max(0, Math.floor((region.r0 - r0) / sy));
  const i1 = Math.min(rows, Math.ceil((region.r1 - r0) / sy));
  const j0 = Math.max(0, Math.floor((region.c0 - c0) / sx));
  const j1 = Math.min(cols, Math.ceil((region.c1 - c0) / sx));
  if (i1 <= i0 || j1 <= j0) return values;
  if (i0 === 0 && j0 === 0 && i1 === rows && j1 === cols) return values;
  const out = new Float32Array((i1 - i0) * (j1 - j0));
  for (let i = i0, k = 0; i < i1; i++, k += j1 - j0) out.set(values.subarray(i * cols + j0, i * cols + j1), k);
  return out;
}

/** A locked range {min, max, absMax} (the tensor's) in the terms of block summary `agg`: {lo, hi}. */
export function rangeFor(range, agg) {
  if (!range) return null;
  if (agg !== 'absmax') return { lo: range.min, hi: range.max };
  const lo = range.min <= 0 && range.max >= 0 ? 0 : Math.min(Math.abs(range.min), Math.abs(range.max));
  return { lo, hi: range.absMax };
}

export class Renderer {
  /** legend: {legendLo, legendHi, colorbar}, the elements that explain the colours. */
  constructor(canvas, dpr, legend) {
    this.canvas = canvas;
    this.ctx = canvas.getContext('2d');
    this.dpr = dpr;
    this.legend = legend;
    this.normaliser = null;
    this.normKey = '';  // identifies the normaliser, so a tile painted with it is not repainted
    this.fitKey = '';  // the view and settings the unlocked scale was fitted for
  }

  /**
   * One colour scale for every tile on screen, whichever is approximate or exact: fitted to the values
   * of the first tile shown for the visible `region` (as a fresh page showing this view would load it, so
   * that a link shows the same colours) under the block summary in force, and kept when the exact tile of
   * that view arrives; refitted when the view or a setting changes. Or `range` (the tensor's
   * {min, max, absMax}) when settings.lock is on. Tiles are repainted only when it changes.
   */
  renormalise(layers, settings, range, region) {
    const { legendLo, legendHi, colorbar } = this.legend;
    const newest = layers[layers.length - 1];
    if (!newest) {
      this.normaliser = null;
      this.normKey = this.fitKey = '';
      legendLo.textContent = legendHi.textContent = '';
      return;
    }
    const agg = resolveAgg(settings);
    const locked = settings.lock ? rangeFor(range, agg) : null;
    const fit = [agg, settings.cmap, settings.norm, settings.clip, Boolean(locked),
      region ? [region.r0, region.r1, region.c0, region.c1].join(',') : ''].join(':');
    if (!locked && fit === this.fitKey && this.normaliser) return;  // the same view: the exact tile keeps the scale
    this.fitKey = fit;
    const values = region ? within(newest, valuesOf(newest, agg), region) : valuesOf(newest, agg);
    const n = makeNormaliser(values, settings.norm, { clipPercent: settings.clip, range: locked });
    const key = [agg, settings.cmap, settings.norm, settings.clip, n.lo, n.hi].join(':');
    if (key === this.normKey) return;
    this.normaliser = n;
    this.normKey = key;
    drawColorbar(colorbar, COLORMAPS[settings.cmap]);
    legendLo.textContent = n.log ? `|x| ${fmtValue(n.lo, 3)}` : fmtValue(n.lo, 4);
    legendHi.textContent = fmtValue(n.hi, 4);
    colorbar.title = `${NORMALISATIONS[settings.norm]} · ${COLORMAP_LABELS[settings.cmap]} · `
      + `${locked ? "the tensor's min/max" : 'this view'}`;
  }

  /** The tile as an image, one pixel per tile value, painted with the current normaliser. */
  paintTile(tile, settings) {
    if (tile.paintKey === this.normKey && tile.image) return tile.image;
    const [rows, cols] = tile.header.shape;
    const image = tile.image || document.createElement('canvas');
    image.width = cols;
    image.height = rows;
    const ctx = image.getContext('2d');
    const data = ctx.createImageData(cols, rows);
    paint(valuesOf(tile, resolveAgg(settings)), data.data, this.normaliser, COLORMAPS[settings.cmap], tile.fields.nonfinite);
    ctx.putImageData(data, 0, 0);
    tile.image = image;
    tile.paintKey = this.normKey;
    return image;
  }

  /**
   * Draw a scene, or the empty background for null. scene: {camera, layers (oldest first), settings,
   * boxes (placement chunks), hotChunk (the index of the highlighted one), hoverBlock, pinned ([r, c])}.
   */
  draw(scene) {
    const { ctx, canvas } = this;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = '#e8ebf0';
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    if (!scene) return;
    const { camera } = scene;
    const sX = camera.scaleX();
    const sY = camera.scaleY();
    const X = (c) => (c - camera.x0) * sX;
    const Y = (r) => (r - camera.y0) * sY;
    const frame = { camera, X, Y, sX, sY };
    ctx.fillStyle = '#ffffff';
    ctx.fillRect(X(0), Y(0), camera.W * sX, camera.H * sY);
    for (const tile of scene.layers) this.drawTile(tile, scene.settings, frame);
    this.drawGridAndText(scene, frame);
    this.markNonFinite(scene.layers[scene.layers.length - 1], frame);
    this.drawChunks(scene.boxes, scene.hotChunk, frame);
    if (scene.hoverBlock) this.drawHover(scene.hoverBlock, frame);
    if (scene.pinned) this.drawPin(scene.pinned, frame);
    ctx.strokeStyle = 'rgba(28, 36, 48, 0.5)';
    ctx.lineWidth = this.dpr;
    ctx.strokeRect(X(0) - 0.5, Y(0) - 0.5, camera.W * sX + 1, camera.H * sY + 1);
  }

  drawTile(tile, settings, { camera, X, Y, sX, sY }) {
    if (!this.normaliser) return;
    const { ctx, canvas } = this;
    const [r0, r1] = tile.header.rows;
    const [c0, c1] = tile.header.cols;
    const [sy, sx] = tile.header.step;
    const [rows, cols] = tile.header.shape;
    // Only the tile pixels in view are drawn: a coarse tile zoomed far in would otherwise be
    // scaled to a canvas millions of pixels wide.
    const i0 = Math.max(0, Math.floor((camera.y0 - r0) / sy));
    const i1 = Math.min(rows, Math.ceil((camera.y0 + canvas.height / sY - r0) / sy));
    const j0 = Math.max(0, Math.floor((camera.x0 - c0) / sx));
    const j1 = Math.min(cols, Math.ceil((camera.x0 + canvas.width / sX - c0) / sx));
    if (i1 <= i0 || j1 <= j0) return;
    const image = this.paintTile(tile, settings);
    ctx.save();
    ctx.beginPath();
    ctx.rect(X(c0), Y(r0), (c1 - c0) * sX, (r1 - r0) * sY);  // the last block may be cut short
    ctx.clip();
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(image, j0, i0, j1 - j0, i1 - i0,
      X(c0 + j0 * sx), Y(r0 + i0 * sy), (j1 - j0) * sx * sX, (i1 - i0) * sy * sY);
    ctx.restore();
  }

  /**
   * A ring round each non-finite pixel of `tile` in view, in its colour, when there are few: a single NaN
   * in a 4096 × 8192 tensor is one pixel at fit, too small to see unmarked.
   */
  markNonFinite(tile, { X, Y, sX, sY }) {
    const flags = tile && tile.fields.nonfinite;
    if (!flags || tile.header.nonfinite_cells > MARK_MAX_CELLS) return;
    const { ctx, dpr, canvas } = this;
    const [r0] = tile.header.rows;
    const [c0] = tile.header.cols;
    const [sy, sx] = tile.header.step;
    const cols = tile.header.shape[1];
    const radius = MARK_RADIUS_CSS * dpr;
    ctx.save();
    ctx.lineWidth = 2 * dpr;
    for (let k = 0; k < flags.length; k++) {
      const colour = flags[k] ? flagRgb(flags[k]) : null;
      if (!colour) continue;
      const i = Math.floor(k / cols);
      const j = k % cols;
      const x = X(c0 + (j + 0.5) * sx);
      const y = Y(r0 + (i + 0.5) * sy);
      if (x < -radius || y < -radius || x > canvas.width + radius || y > canvas.height + radius) continue;
      const r = Math.max(radius, Math.min(sx * sX, sy * sY) / 2 + 2 * dpr);
      ctx.strokeStyle = '#ffffff';
      ctx.beginPath();
      ctx.arc(x, y, r + dpr, 0, 2 * Math.PI);
      ctx.stroke();
      ctx.strokeStyle = `rgb(${colour.join(',')})`;
      ctx.beginPath();
      ctx.arc(x, y, r, 0, 2 * Math.PI);
      ctx.stroke();
    }
    ctx.restore();
  }

  /** Cell grid and value text at high zoom, from the newest element-level tile. */
  drawGridAndText({ layers, settings }, { camera, X, Y, sX, sY }) {
    const { ctx, canvas, dpr } = this;
    const tile = [...layers].reverse().find((t) => t.header.step[0] === 1 && t.header.step[1] === 1);
    if (!tile || sX < 10 * dpr || sY < 10 * dpr) return;
    const [r0, r1] = tile.header.rows;
    const [c0, c1] = tile.header.cols;
    const ra = Math.max(r0, Math.floor(camera.y0));
    const rb = Math.min(r1, Math.ceil(camera.y0 + canvas.height / sY));
    const ca = Math.max(c0, Math.floor(camera.x0));
    const cb = Math.min(c1, Math.ceil(camera.x0 + canvas.width / sX));
    ctx.strokeStyle = 'rgba(255, 255, 255, 0.45)';
    ctx.lineWidth = 1;
    ctx.beginPath();
    for (let r = ra; r <= rb; r++) { ctx.moveTo(X(ca), Math.round(Y(r)) + 0.5); ctx.lineTo(X(cb), Math.round(Y(r)) + 0.5); }
    for (let c = ca; c <= cb; c++) { ctx.moveTo(Math.round(X(c)) + 0.5, Y(ra)); ctx.lineTo(Math.round(X(c)) + 0.5, Y(rb)); }
    ctx.stroke();
    if (sX < TEXT_MIN_CELL_CSS * dpr || sY < 14 * dpr) return;
    const values = tile.fields.value || tile.fields[tile.header.fields[0]];  // the element's own value
    const painted = valuesOf(tile, resolveAgg(settings));  // the value its colour stands for
    const cols = tile.header.shape[1];
    const lut = COLORMAPS[settings.cmap];
    const size = Math.min(12 * dpr, sY * 0.42, sX / 5.2);
    ctx.font = `${size}px ui-monospace, Menlo, Consolas, monospace`;
    ctx.textAlign = 'center';
    ctx.textBaseline = 'middle';
    for (let r = ra; r < rb; r++) {
      for (let c = ca; c < cb; c++) {
        const k = (r - r0) * cols + (c - c0);
        const v = values[k];
        let light = false;
        if (!Number.isNaN(v)) {
          const [R, G, B] = rgbOf(this.normaliser.map(painted[k]), lut);
          light = 0.299 * R + 0.587 * G + 0.114 * B < 140;
        }
        ctx.fillStyle = light ? '#ffffff' : '#111111';
        ctx.fillText(fmtCell(v), X(c + 0.5), Y(r + 0.5));
      }
    }
  }

  /** Placement chunks as dashed boxes labelled with their ranks; the hot one in a solid line. */
  drawChunks(boxes, hotChunk, { X, Y, sX, sY }) {
    const { ctx, dpr } = this;
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
      const hot = b.i === hotChunk;  // outlined only: a tint would give equal values unequal colours
      ctx.lineWidth = hot ? 2 * dpr : dpr;
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

  /** A red frame round the hovered block (one element, or the elements one pixel summarises). */
  drawHover(block, { X, Y, sX, sY }) {
    const { ctx, dpr } = this;
    ctx.save();
    ctx.lineWidth = 1.5 * dpr;
    ctx.strokeStyle = '#ff3b30';
    const x = X(block.c0);
    const y = Y(block.r0);
    const w = Math.max(2 * dpr, (block.c1 - block.c0) * sX);
    const h = Math.max(2 * dpr, (block.r1 - block.r0) * sY);
    ctx.strokeRect(x, y, w, h);
    ctx.restore();
  }

  /** The pinned element: a black and white frame, at least PIN_MIN_CSS wide so that it shows at any zoom. */
  drawPin([r, c], { X, Y, sX, sY }) {
    const { ctx, dpr } = this;
    const w = Math.max(PIN_MIN_CSS * dpr, sX);
    const h = Math.max(PIN_MIN_CSS * dpr, sY);
    const x = X(c) + sX / 2 - w / 2;
    const y = Y(r) + sY / 2 - h / 2;
    ctx.save();
    ctx.lineWidth = 3 * dpr;
    ctx.strokeStyle = '#ffffff';
    ctx.strokeRect(x, y, w, h);
    ctx.lineWidth = 1.5 * dpr;
    ctx.strokeStyle = '#111111';
    ctx.strokeRect(x, y, w, h);
    ctx.restore();
  }
}
