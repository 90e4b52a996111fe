// Pinning: a click on the heatmap pins the element under the cursor, and a card shows its tensor index, its
// exact value (read as a 1 × 1 tile, at any zoom) and where it lives: chunk, rank and file. A pin of the
// diff view shows a, b and a − b.

import { getTile } from './api.js';
import { el, value as fmtValue } from './format.js';

const MAX_CHUNKS_LISTED = 4;  // a Partial or replicated element lives in several chunks: name the first few

/** The chunks (with their index in the record) whose box holds global tensor index `index`. */
export function chunksAt(chunks, index) {
  const out = [];
  (chunks || []).forEach((c, i) => {
    if (c.offsets.every((o, d) => index[d] >= o && index[d] < o + c.shape[d])) out.push({ chunk: c, i });
  });
  return out;
}

/** The tile query of the one element at tensor index `index`, viewed along `axes` (N-D) like the heatmap. */
export function elementQuery(index, axes) {
  const nd = index.length;
  const query = { r0: 0, r1: 1, c0: 0, c1: 1, h: 1, w: 1, exact: 0 };
  if (nd === 1) Object.assign(query, { c0: index[0], c1: index[0] + 1 });
  if (nd >= 2) {
    const [ay, ax] = axes;
    Object.assign(query, { r0: index[ay], r1: index[ay] + 1, c0: index[ax], c1: index[ax] + 1, axes: `${ay},${ax}` });
    if (nd > 2) query.fixed = index.filter((_, d) => d !== ay && d !== ax).join(',');
  }
  return query;
}

async function readElement(endpoint, params, index, axes) {
  const tile = await getTile(endpoint, { ...params, ...elementQuery(index, axes) });
  const field = tile.fields.value || tile.fields[tile.header.fields[0]];
  return field[0];
}

export class PinCard {
  /** actions: close() unpins, copy() copies the pinned element's `tensormorph show` command. */
  constructor(root, { close, copy }) {
    this.root = root;
    this.close = close;
    this.copy = copy;
    this.seq = 0;
    this.hide();
  }

  hide() {
    this.seq++;
    this.root.hidden = true;
    this.root.replaceChildren();
    delete this.root.dataset.index;
    delete this.root.dataset.value;
  }

  /**
   * Show the pin at tensor index `index` of `source` (the heatmap's: endpoint, params, record, indexOffset,
   * sides for a diff), viewed along `axes`. Resolves once the values are read.
   */
  async show(source, index, axes) {
    const seq = ++this.seq;
    const offset = source.indexOffset;
    const global = offset ? index.map((v, d) => v + offset[d]) : index;
    const label = `[${index.join(', ')}]`;
    const facts = el('dl', { class: 'facts' });
    const row = (name, text, attrs = {}) => facts.append(el('dt', {}, name), el('dd', attrs, text));
    this.root.hidden = false;
    this.root.dataset.index = index.join(',');
    delete this.root.dataset.value;
    this.root.replaceChildren(
      el('div', { class: 'pin-head' },
        el('b', { 'data-testid': 'pin-index' }, label),
        offset ? el('span', { class: 'muted' }, ` global [${global.join(', ')}]`) : null,
        el('span', { class: 'grow' }),
        el('button', { type: 'button', class: 'linkish', 'data-testid': 'pin-copy', title: 'Copy the tensormorph show command of this element',
          onclick: () => this.copy() }, 'copy show'),
        el('button', { type: 'button', class: 'close', 'aria-label': 'Unpin (Esc)', title: 'Unpin (Esc)', onclick: () => this.close() }, '×')),
      facts);
    const valueEl = el('dd', { 'data-testid': 'pin-value', class: 'spinner' }, 'reading');
    facts.append(el('dt', {}, source.sides ? 'a − b' : 'value'), valueEl);
    let sides = [];
    try {
      const reads = [readElement(source.endpoint, source.params, index, axes),
        ...(source.sides || []).map((s) => readElement(s.endpoint, s.params, index, axes))];
      const [v, ...others] = await Promise.all(reads);
      if (seq !== this.seq) return;
      valueEl.classList.remove('spinner');
      valueEl.textContent = fmtValue(v, 9);
      this.root.dataset.value = String(v);
      sides = others;
    } catch (err) {
      if (seq !== this.seq) return;
      valueEl.className = 'error-text';
      valueEl.textContent = `could not read it: ${err.message}`;
    }
    if (source.sides) {
      source.sides.forEach((s, k) => row(s.label, sides.length ? fmtValue(sides[k], 9) : '–'));
      return;
    }
    const found = chunksAt(source.record && source.record.chunks, global);
    if (!found.length) return;
    const listed = found.slice(0, MAX_CHUNKS_LISTED);
    const more = found.length > listed.length ? ` … (${found.length})` : '';
    row('chunk', listed.map(({ chunk, i }) => `#${i} [${chunk.offsets.join(', ')}]`).join(', ') + more, { 'data-testid': 'pin-chunk' });
    const ranks = [...new Set(listed.flatMap(({ chunk }) => chunk.ranks))];
    row('rank', ranks.length ? ranks.join(', ') : '–', { 'data-testid': 'pin-rank' });
    row('file', [...new Set(listed.map(({ chunk }) => chunk.file))].join(', '), { 'data-testid': 'pin-file' });
  }
}
