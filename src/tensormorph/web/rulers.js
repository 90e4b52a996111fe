// Index rulers along the heatmap: column indices above it, row indices to its left, with the hovered and
// the pinned element marked. Each ruler is a canvas of its own, aligned with the heatmap canvas, and
// carries its tick indices in data-ticks (read by the tests).

const MIN_GAP_CSS = { top: 64, left: 26 };  // the least room between two labelled ticks, CSS pixels
const FONT_CSS = 10;
const HOVER = 'rgba(47, 111, 222, 0.35)';
const PIN = 'rgba(20, 24, 32, 0.85)';

/** The step between labelled ticks: 1, 2 or 5 × 10^k elements, at least minPx device pixels apart. */
export function tickStep(scale, minPx) {
  const least = minPx / scale;
  for (let p = 1; ; p *= 10) {
    for (const m of [1, 2, 5]) if (m * p >= least) return m * p;
  }
}

/** A tick label that fits the left ruler: plain up to 999,999, then 1.05M. */
export function tickLabel(n) {
  if (n < 1e6) return String(n);
  return `${Number((n / 1e6).toPrecision(3))}M`;
}

export class Rulers {
  constructor(top, left, dpr) {
    this.top = top;
    this.left = left;
    this.dpr = dpr;
  }

  resize() {
    for (const canvas of [this.top, this.left]) {
      const w = Math.max(1, Math.round(canvas.clientWidth * this.dpr));
      const h = Math.max(1, Math.round(canvas.clientHeight * this.dpr));
      if (canvas.width !== w) canvas.width = w;
      if (canvas.height !== h) canvas.height = h;
    }
  }

  /** Draw for `camera` (null: blank); marks: {hover: [r, c] or null, pin: [r, c] or null}. */
  draw(camera, { hover = null, pin = null } = {}) {
    const view = camera && camera.W ? camera : null;
    this.axis(this.top, view, 'top', hover && hover[1], pin && pin[1]);
    this.axis(this.left, view, 'left', hover && hover[0], pin && pin[0]);
  }

  axis(canvas, camera, side, hovered, pinned) {
    const ctx = canvas.getContext('2d');
    const { dpr } = this;
    const horizontal = side === 'top';
    const length = horizontal ? canvas.width : canvas.height;
    const depth = horizontal ? canvas.height : canvas.width;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = '#f6f7f9';
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    if (!camera) {
      canvas.dataset.ticks = '';
      return;
    }
    const scale = horizontal ? camera.scaleX() : camera.scaleY();
    const origin = horizontal ? camera.x0 : camera.y0;
    const n = horizontal ? camera.W : camera.H;
    const at = (i) => (i - origin) * scale;
    const band = (i, colour) => {
      if (i === null || i === undefined || i < 0 || i >= n) return;
      const a = at(i);
      const w = Math.max(2 * dpr, scale);
      ctx.fillStyle = colour;
      if (horizontal) ctx.fillRect(a, 0, w, depth);
      else ctx.fillRect(0, a, depth, w);
    };
    band(hovered, HOVER);
    band(pinned, PIN);
    const step = tickStep(scale, MIN_GAP_CSS[side] * dpr);
    const first = Math.max(0, Math.ceil(origin / step) * step);
    const last = Math.min(n - 1, Math.floor((origin + length / scale) / step) * step);
    const ticks = [];
    ctx.strokeStyle = '#9aa3b2';
    ctx.lineWidth = 1;
    ctx.fillStyle = '#4a5566';
    ctx.font = `${FONT_CSS * dpr}px ui-monospace, Menlo, Consolas, monospace`;
    ctx.textBaseline = horizontal ? 'top' : 'middle';
    ctx.textAlign = horizontal ? 'left' : 'right';
    ctx.beginPath();
    for (let i = first; i <= last; i += step) {
      ticks.push(i);
      // a tick at the start of element i, its label just after it
      const a = Math.round(at(i)) + 0.5;
      if (horizontal) {
        ctx.moveTo(a, depth - 5 * dpr);
        ctx.lineTo(a, depth);
        ctx.fillText(tickLabel(i), a + 2 * dpr, 2 * dpr);
      } else {
        ctx.moveTo(depth - 5 * dpr, a);
        ctx.lineTo(depth, a);
        ctx.fillText(tickLabel(i), depth - 6 * dpr, a + Math.max(6 * dpr, Math.min(scale / 2, 40 * dpr)));
      }
    }
    ctx.stroke();
    ctx.strokeStyle = '#dfe3ea';
    ctx.beginPath();
    if (horizontal) { ctx.moveTo(0, depth - 0.5); ctx.lineTo(length, depth - 0.5); }
    else { ctx.moveTo(depth - 0.5, 0); ctx.lineTo(depth - 0.5, length); }
    ctx.stroke();
    canvas.dataset.ticks = ticks.join(',');
  }
}
