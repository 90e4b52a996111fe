// Pointer interaction on the heatmap canvas (drag to pan, wheel and double-click to zoom) and the
// hover readout: what lies under the cursor, written to the status bar and told to the inspector.
// Positions are in device pixels, as the camera counts them.

import { int, value as fmtValue } from './format.js';

const NBSP = '\u00a0';
const CLICK_SLOP_CSS = 4;  // a press that moves less than this (CSS pixels) is a click: it pins

/**
 * Listen to the canvas. handlers: dpr, hasView() (false: leave the wheel to the page),
 * panBy(dx, dy), zoomAt(px, py, factor), hoverAt({px, py} or null when the pointer left), clickAt(px, py).
 */
export function attachPointer(canvas, { dpr, hasView, panBy, zoomAt, hoverAt, clickAt }) {
  let drag = null;
  canvas.addEventListener('pointerdown', (e) => {
    if (e.button !== 0) return;
    canvas.focus({ preventScroll: true });
    drag = { x: e.clientX, y: e.clientY, travel: 0 };
    canvas.setPointerCapture(e.pointerId);
  });
  canvas.addEventListener('pointermove', (e) => {
    if (drag) {
      const dx = e.clientX - drag.x;
      const dy = e.clientY - drag.y;
      if (Math.abs(dx) + Math.abs(dy) > 0) {
        drag.travel += Math.abs(dx) + Math.abs(dy);
        canvas.classList.add('dragging');
        drag.x = e.clientX;
        drag.y = e.clientY;
        panBy(dx * dpr, dy * dpr);
      }
    }
    hoverAt({ px: e.offsetX * dpr, py: e.offsetY * dpr });
  });
  const end = (e) => {
    if (drag) canvas.releasePointerCapture(e.pointerId);
    if (drag && e.type === 'pointerup' && drag.travel < CLICK_SLOP_CSS) clickAt(e.offsetX * dpr, e.offsetY * dpr);
    drag = null;
    canvas.classList.remove('dragging');
  };
  canvas.addEventListener('pointerup', end);
  canvas.addEventListener('pointercancel', end);
  canvas.addEventListener('pointerleave', () => {
    if (!drag) hoverAt(null);
  });
  canvas.addEventListener('wheel', (e) => {
    if (!hasView()) return;
    e.preventDefault();
    const unit = e.deltaMode === 1 ? 0.05 : e.deltaMode === 2 ? 1 : 0.002;
    zoomAt(e.offsetX * dpr, e.offsetY * dpr, Math.exp(-e.deltaY * unit));
  }, { passive: false });
  canvas.addEventListener('dblclick', (e) => zoomAt(e.offsetX * dpr, e.offsetY * dpr, e.shiftKey ? 0.5 : 2));
}

/**
 * The readout of what is under the cursor. Its element carries data-row, data-col, data-index,
 * data-exact and (for a single element) data-value, which the tests read.
 */
export class HoverReadout {
  /** onHover({chunk, index}): the placement chunk under the cursor changed (chunk -1: none). */
  constructor(el, onHover) {
    this.el = el;
    this.onHover = onHover;
    this.position = null;  // {px, py} in canvas device pixels, null when the pointer is away
    this.block = null;  // the view block under the cursor, for the frame drawn round it
    this.hotChunk = -1;
  }

  /** Forget the cursor and the hot chunk without telling anyone (a new tensor is coming). */
  reset() {
    this.position = null;
    this.hotChunk = -1;
  }

  clear() {
    this.el.textContent = NBSP;
  }

  /** Work out what is under the cursor and write it. tiles: the TileLoader. */
  update({ source, camera, slice, tiles }) {
    const { el } = this;
    const previousChunk = this.hotChunk;
    this.block = null;
    const [r, c] = this.position && camera.W && source ? camera.elementAt(this.position.px, this.position.py) : [-1, -1];
    if (r < 0 || c < 0 || r >= camera.H || c >= camera.W) {
      el.textContent = NBSP;
      delete el.dataset.value;
      this.setHotChunk(-1, previousChunk, null);
      return;
    }
    const index = slice.tensorIndex(r, c);
    el.dataset.row = r;
    el.dataset.col = c;
    el.dataset.index = index.join(',');
    const offset = source.indexOffset;
    const at = offset
      ? `[${index.join(', ')}] (global [${index.map((v, d) => v + offset[d]).join(', ')}])`
      : `[${index.join(', ')}]`;
    const tile = tiles.tileAt(r, c);
    if (!tile) {
      el.textContent = `${at}  loading…`;
      delete el.dataset.value;
    } else {
      this.describe(tile, r, c, at, slice);
    }
    const chunk = slice.chunkBoxes(source.chunks).find((b) => b.r0 <= r && r < b.r1 && b.c0 <= c && c < b.c1);
    this.setHotChunk(chunk ? chunk.i : -1, previousChunk, index);
  }

  /** Write the value at (r, c) from `tile`: the element, the block's statistics, or a sample. */
  describe(tile, r, c, at, slice) {
    const { el } = this;
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
    this.block = block;
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
      el.textContent = `${slice.blockLabel(block)} (${int(n)} el.)  ` +
        `min ${stat('min')}  max ${stat('max')}  mean ${stat('mean')}  |max| ${stat('absmax')}`;
    } else {
      const v = tile.fields.value[k];
      delete el.dataset.value;
      el.textContent = `${at} ≈ ${fmtValue(v, 5)}  (sampled from a ${sy}×${sx} block; exact loading…)`;
    }
  }

  setHotChunk(i, previous, index) {
    this.hotChunk = i;
    if (i !== previous || index === null) this.onHover({ chunk: i, index });
  }
}
