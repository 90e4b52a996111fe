// Tile fetching for the heatmap: requests, the stack of loaded tiles, and cancellation.
//
// For the visible region we ask for a tile at the canvas pixel size, snapped to the step grid so
// that small pans reuse loaded tiles: first exact=0 (a strided sample, drawn at once with the
// "approximate" badge), then exact=1 replaces it. Older tiles stay underneath while new ones load,
// so panning never flashes blank. Every request carries a generation number; an answer from an
// older generation (another tensor, another slice) is dropped.

import { getTile } from './api.js';

const KEEP_TILES = 4;
const FETCH_DELAY_MS = 70;  // pans and zooms within this settle into one request

/** Whether region `reg` holds all of region `want` at the same step. */
export function covers(reg, want) {
  return reg.r0 <= want.r0 && reg.r1 >= want.r1 && reg.c0 <= want.c0 && reg.c1 >= want.c1
    && reg.stepY === want.stepY && reg.stepX === want.stepX;
}

/** Ask for a 1×1 tile only to learn the view shape, which for local(rank) views only the server knows. */
export async function probeViewShape(endpoint, params) {
  const probe = await getTile(endpoint, { ...params, r0: 0, r1: 1, c0: 0, c1: 1, h: 1, w: 1, exact: 0 });
  return probe.header.view_shape;
}

export class TileLoader {
  /**
   * wanted(): {endpoint, params, reg} for the visible region (params: the fixed and view query
   * parameters), or null when there is nothing to show. viewShape(): the [H, W] the tiles must
   * have. onViewShape(H, W): a tile says the view has another shape (the tiles are dropped).
   * onTile(tile): a tile was kept. onError(err): a request failed.
   */
  constructor({ wanted, viewShape, onViewShape, onTile, onError }) {
    Object.assign(this, { wanted, viewShape, onViewShape, onTile, onError });
    this.layers = [];  // oldest first; each tile has reg (what was asked) and exact
    this.generation = 0;
    this.inflight = null;
    this.fetchTimer = undefined;
  }

  get newest() { return this.layers[this.layers.length - 1]; }

  /** Start a new generation: every answer still on its way is dropped. */
  restart() {
    this.clear();
    return ++this.generation;
  }

  isCurrent(generation) { return generation === this.generation; }

  /** Drop every tile and cancel what is on its way. */
  clear() {
    this.abort();
    this.layers = [];
  }

  abort() {
    clearTimeout(this.fetchTimer);
    if (this.inflight) this.inflight.controller.abort();
    this.inflight = null;
  }

  schedule() {
    clearTimeout(this.fetchTimer);
    this.fetchTimer = setTimeout(() => this.fetchVisible(), FETCH_DELAY_MS);
  }

  async fetchVisible() {
    const want = this.wanted();
    if (!want) return;
    const { endpoint, reg } = want;
    const covering = this.layers.filter((t) => covers(t.reg, reg));
    if (covering.some((t) => t.exact)) return;
    if (this.inflight && covers(this.inflight.reg, reg)) return;  // already on its way
    if (this.inflight) this.inflight.controller.abort();
    const controller = new AbortController();
    const generation = ++this.generation;
    this.inflight = { reg, controller, generation };
    const params = { ...want.params, r0: reg.r0, r1: reg.r1, c0: reg.c0, c1: reg.c1, h: reg.h, w: reg.w };
    try {
      if (!covering.length) {
        const approx = await getTile(endpoint, { ...params, exact: 0 }, { signal: controller.signal });
        if (generation !== this.generation) return;
        this.add(approx, reg);
        // At one element per pixel the sample is every element: the server marks it exact.
        if (!approx.header.approximate) return;
      }
      const exact = await getTile(endpoint, { ...params, exact: 1 }, { signal: controller.signal });
      if (generation !== this.generation) return;
      this.add(exact, reg);
    } catch (err) {
      if (err.name !== 'AbortError' && generation === this.generation) this.onError(err);
    } finally {
      if (this.inflight && this.inflight.generation === generation) this.inflight = null;
    }
  }

  add(tile, reg) {
    const [vh, vw] = tile.header.view_shape;
    const [H, W] = this.viewShape();
    if (vh !== H || vw !== W) {
      // The server knows the view better (local views, unusual ranks): let the owner adopt its shape.
      this.layers = [];
      this.onViewShape(vh, vw);
      return;
    }
    tile.reg = reg;
    tile.exact = !tile.header.approximate;
    if (tile.exact) this.layers = this.layers.filter((t) => !(t.reg === reg || (!t.exact && covers(reg, t.reg))));
    this.layers.push(tile);
    if (this.layers.length > KEEP_TILES) this.layers.splice(0, this.layers.length - KEEP_TILES);
    this.onTile(tile);
  }

  /** The newest tile that holds view element (r, c). */
  tileAt(r, c) {
    return [...this.layers].reverse().find((t) =>
      t.header.rows[0] <= r && r < t.header.rows[1] && t.header.cols[0] <= c && c < t.header.cols[1]);
  }
}
