// Drawing for the heatmap: colour-maps tiles into images, draws them through the camera, and overlays
// the cell grid with values, the placement chunks and the hovered block. Also keeps the legend.

import { COLORMAPS, COLORMAP_LABELS, NORMALISATIONS, drawColorbar, makeNormaliser, paint, rgbOf } from './colormaps.js';
import { cell as fmtCell, value as fmtValue } from './format.js';

const TEXT_MIN_CELL_CSS = 34;  // cells at least this wide get their value written in them

/** The field a tile is drawn from: the chosen aggregation when the tile has it. */
export function fieldOf(tile, agg) {
  const { fields } = tile;
  if (fields[agg]) return agg;
  return fields.value ? 'value' : tile.header.fields[0];
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
  }

  /** Fit the colour scale to the newest tile and update the legend. */
  renormalise(layers, settings, generation) {
    const { legendLo, legendHi, colorbar } = this.legend;
    const newest = layers[layers.length - 1];
    if (!newest) {
      this.normaliser = null;
      legendLo.textContent = legendHi.textContent = '';
      return;
    }
    const field = fieldOf(newest, settings.agg);
    this.normaliser = makeNormaliser(newest.fields[field], settings.norm, { clipPercent: settings.clip });
    this.normKey = `${generation}:${layers.length}:${field}:${settings.cmap}:${settings.norm}:${settings.clip}:${newest.reg.r0},${newest.reg.c0}`;
    drawColorbar(colorbar, COLORMAPS[settings.cmap]);
    const n = this.normaliser;
    legendLo.textContent = n.log ? `|x| ${fmtValue(n.lo, 3)}` : fmtValue(n.lo, 4);
    legendHi.textContent = fmtValue(n.hi, 4);
    colorbar.title = `${NORMALISATIONS[settings.norm]} · ${COLORMAP_LABELS[settings.cmap]}`;
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
    paint(tile.fields[fieldOf(tile, settings.agg)], data.data, this.normaliser, COLORMAPS[settings.cmap]);
    ctx.putImageData(data, 0, 0);
    tile.image = image;
    tile.paintKey = this.normKey;
    return image;
  }

  /**
   * Draw a scene, or the empty background for null. scene: {camera, layers (oldest first), settings,
   * boxes (placement chunks), hotChunk (the index of the highlighted one), hoverBlock}.
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
    this.drawChunks(scene.boxes, scene.hotChunk, frame);
    if (scene.hoverBlock) this.drawHover(scene.hoverBlock, frame);
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
    const values = tile.fields[fieldOf(tile, settings.agg)];
    const cols = tile.header.shape[1];
    const lut = COLORMAPS[settings.cmap];
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

  /** Placement chunks as dashed boxes labelled with their ranks; the hot one filled. */
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
      const hot = b.i === hotChunk;
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
}
