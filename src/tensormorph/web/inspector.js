// The Inspector: what a tensor is (dtype, shape, bytes), where its bytes live (file-level shard,
// placement chunks with their ranks), local(rank) vs full() with the cost of reading it, and its
// statistics with a histogram. For a diff row it shows the comparison figures instead.

import { getJSON } from './api.js';
import { statusLabel } from './diff.js';
import { bytes, count, el, int, percent, seconds, shape as fmtShape, value as fmtValue } from './format.js';
import { IntegrityPanel } from './integrity.js';

const MAX_CHUNK_ROWS = 2000;

function facts(pairs) {
  const dl = el('dl', { class: 'facts' });
  for (const [k, v, attrs] of pairs) {
    if (v === null || v === undefined || v === '') continue;
    dl.append(el('dt', {}, k), el('dd', attrs || {}, v));
  }
  return dl;
}

function section(title, ...children) {
  return el('section', { class: 'insp-section' }, el('h3', {}, title), ...children);
}

export class Inspector {
  /**
   * @param {HTMLElement} root
   * @param {{onRank: (rank: number|null) => void, onFocusIndex: (index: number[]) => void,
   *          onChunk: (chunk: object) => void, onStats: (stats: object, view: {ck, name, rank}) => void}} hooks
   */
  constructor(root, { onRank, onFocusIndex, onChunk, onStats }) {
    this.root = root;
    this.onRank = onRank;
    this.onFocusIndex = onFocusIndex;
    this.onChunk = onChunk;
    this.onStats = onStats;
    this.statsSeq = 0;
    this.histLog = false;
    this.histLogY = false;
    this.confirmed = new Set();  // tensor keys whose above-budget read the user accepted
  }

  /** Show `parts` (sections), leaving the checkpoint overview: a verify under way stops. */
  show(...parts) {
    if (this.integrity) this.integrity.close();
    this.integrity = null;
    this.root.replaceChildren(...parts);
  }

  // ---------------------------------------------------------------- checkpoint overview

  /** The checkpoint overview: figures, dtypes, its integrity (files, parity, verify) and objects. */
  showCheckpoint(ck, summary) {
    this.record = null;
    const dtypes = el('table', { class: 'chunks' },
      el('tr', {}, el('th', {}, 'dtype'), el('th', {}, 'tensors'), el('th', {}, 'params'), el('th', {}, 'bytes')));
    for (const [d, t] of Object.entries(summary.totals_by_dtype || {})) {
      dtypes.append(el('tr', {}, el('td', {}, d), el('td', {}, int(t.tensors)), el('td', {}, count(t.params)), el('td', {}, bytes(t.nbytes))));
    }
    const panel = new IntegrityPanel(ck, summary);
    const parts = [
      section('Checkpoint', el('div', { class: 'insp-name' }, summary.path),
        facts([['format', summary.format], ['tensors', int(summary.tensor_count)], ['params', `${count(summary.params)} (${int(summary.params)})`],
          ['bytes', `${bytes(summary.nbytes)} (${int(summary.nbytes)})`]])),
      section('By dtype', el('div', { class: 'chunks-wrap' }, dtypes)),
      ...panel.sections,
    ];
    const meta = Object.entries(summary.metadata || {}).filter(([, v]) => v !== null && typeof v !== 'object');
    if (meta.length) parts.push(section('Metadata', facts(meta.slice(0, 40).map(([k, v]) => [k, String(v)]))));
    parts.push(section('Tip', el('p', { class: 'note' }, 'Pick a tensor on the left. Search takes names, shapes such as 4096x* and dtypes such as bf16.')));
    this.show(...parts);
    this.integrity = panel;
  }

  // ---------------------------------------------------------------- tensor

  /**
   * @param {string} ck checkpoint id
   * @param {object} record /tensor answer
   * @param {number|null} rank the local(rank) in view, or null for full()
   */
  showTensor(ck, record, rank) {
    this.ck = ck;
    this.record = record;
    this.rank = rank;
    this.key = `${ck}|${record.name}`;
    const itemsize = record.numel ? record.nbytes / record.numel : 0;
    this.itemsize = itemsize;

    const head = section('Tensor',
      el('div', { class: 'insp-name', 'data-testid': 'inspector-name' }, record.name),
      facts([
        ['dtype', record.dtype, { 'data-testid': 'inspector-dtype' }],
        ['shape', `${fmtShape(record.shape)}`, { 'data-testid': 'inspector-shape' }],
        ['elements', int(record.numel)],
        ['bytes', `${bytes(record.nbytes)} (${int(record.nbytes)})`, { 'data-testid': 'inspector-bytes' }],
        ['stored', record.split],
      ]));

    const where = [];
    if (record.file_shard) {
      const [k, n] = record.file_shard;
      where.push(['file shard', `shard ${k} of ${n}`, { 'data-testid': 'file-shard' }], ['file', record.files[0]]);
    } else if (record.files.length === 1) {
      where.push(['file', record.files[0]]);
    } else {
      where.push(['files', `${record.files.length}: ${record.files.slice(0, 6).join(', ')}${record.files.length > 6 ? ', …' : ''}`]);
    }
    if (record.placement) {
      const p = record.placement;
      const names = p.mesh_dim_names && p.mesh_dim_names.length ? ` (${p.mesh_dim_names.join(', ')})` : '';
      where.push(['mesh', `${p.mesh_shape.join('×')}${names}`], ['placements', p.placements.join(', ')]);
    }
    if (record.reduction) {
      const red = record.reduction;
      const dims = red.mesh_dims.length ? ` over mesh dim${red.mesh_dims.length > 1 ? 's' : ''} ${red.mesh_dims.join(', ')}` : '';
      where.push(['value', `Partial(${red.op})${dims}: ${red.contributions} contribution${red.contributions === 1 ? '' : 's'}, reduced in order`,
        { 'data-testid': 'reduction' }]);
    }
    const storage = section('Where the data lives', facts(where));

    this.costEl = el('div', { class: 'cost', 'data-testid': 'cost' });
    const rankSelect = el('select', { 'data-testid': 'rank-select', 'aria-label': 'View', disabled: !record.ranks || !record.ranks.length });
    rankSelect.append(new Option('full()', ''));
    for (const r of record.ranks || []) rankSelect.append(new Option(`local(${r})`, String(r)));
    rankSelect.value = rank === null || rank === undefined ? '' : String(rank);
    rankSelect.addEventListener('change', () => {
      const value = rankSelect.value === '' ? null : Number(rankSelect.value);
      this.onRank(value);
    });
    const placement = section(`Placement · ${record.chunk_count} chunk${record.chunk_count === 1 ? '' : 's'}`,
      el('div', { class: 'rank-row' }, el('label', {}, 'view ', rankSelect), this.costEl),
      this.chunksTable(record, rank));

    this.statsEl = el('div', { 'data-testid': 'stats', class: 'stats' });
    const statsSection = section('Statistics', this.statsEl);
    this.show(head, storage, placement, statsSection);
    this.renderCost();
    this.loadStats();
  }

  /** Bytes and seconds of reading the current view: full() from the server, local(r) from chunks. */
  viewCost() {
    const r = this.record;
    if (this.rank === null || this.rank === undefined) return { bytes: r.full_cost.bytes, seconds: r.full_cost.seconds };
    let n = 0;
    for (const c of r.chunks) if (c.ranks.includes(this.rank)) n += c.shape.reduce((a, b) => a * b, 1);
    const b = n * this.itemsize;
    return { bytes: b, seconds: b / 1e9 };
  }

  renderCost() {
    const { bytes: b, seconds: s } = this.viewCost();
    const budget = this.record.read_budget;
    const over = budget !== null && budget !== undefined && b > budget;
    const what = this.rank === null || this.rank === undefined ? 'full()' : `local(${this.rank})`;
    this.costEl.className = `cost${over ? ' over' : ''}`;
    this.costEl.textContent = `${what}: reads ${bytes(b)}, ~${seconds(s)}${budget ? ` · budget ${bytes(budget)}` : ''}`;
    this.costEl.title = over ? 'Above the read budget: statistics ask for confirmation' : 'Estimated at 1 GB/s';
  }

  chunksTable(record, rank) {
    const wrap = el('div', { class: 'chunks-wrap' });
    const partial = Boolean(record.reduction);
    // The file goes last and gives way (cut, whole in its title): the short columns always show.
    const table = el('table', { class: 'chunks', 'data-testid': 'chunks' },
      el('tr', {}, el('th', {}, '#'), el('th', {}, 'offsets'), el('th', {}, 'shape'), el('th', {}, 'ranks'),
        partial ? el('th', { title: 'which Partial contribution this box belongs to' }, 'contrib.') : null, el('th', {}, 'file')));
    this.chunkRows = [];
    const chunks = record.chunks || [];
    const local = rank !== null && rank !== undefined;
    chunks.slice(0, MAX_CHUNK_ROWS).forEach((c, i) => {
      const mine = local && c.ranks.includes(rank);
      const open = () => this.onChunk(c);
      const tr = el('tr', {
        class: `pick${mine ? ' mine' : ''}`, 'data-chunk': i, tabindex: 0,
        title: local ? `Show local(${c.ranks[0] ?? '?'})` : 'Show this chunk in the heatmap',
        onclick: open, onkeydown: (e) => { if (e.key === 'Enter') open(); },
      },
      el('td', {}, String(i)), el('td', {}, `[${c.offsets.join(', ')}]`), el('td', {}, fmtShape(c.shape)),
      el('td', {}, c.ranks.length ? c.ranks.join(',') : '–'),
      partial ? el('td', {}, String(c.contribution)) : null,
      el('td', { class: 'file', title: `${c.file}${c.byte_range ? `\nbytes ${c.byte_range[0]}–${c.byte_range[1]}` : ''}` }, c.file));
      this.chunkRows.push(tr);
      table.append(tr);
    });
    wrap.append(table);
    if (chunks.length > MAX_CHUNK_ROWS) wrap.append(el('div', { class: 'note' }, `… and ${int(chunks.length - MAX_CHUNK_ROWS)} more`));
    return wrap;
  }

  /** Highlight the chunk under the heatmap cursor. */
  highlight({ chunk }) {
    if (!this.chunkRows) return;
    this.chunkRows.forEach((tr, i) => tr.classList.toggle('hot', i === chunk));
    const row = this.chunkRows[chunk];
    if (row) {
      const wrap = row.closest('.chunks-wrap');
      if (wrap && (row.offsetTop < wrap.scrollTop + 20 || row.offsetTop > wrap.scrollTop + wrap.clientHeight - 20)) {
        wrap.scrollTop = row.offsetTop - wrap.clientHeight / 2;
      }
    }
  }

  async loadStats({ confirm = false } = {}) {
    const seq = ++this.statsSeq;
    const rec = this.record;
    const rankKey = `${this.key}|${this.rank ?? 'full'}`;
    const confirmed = confirm || this.confirmed.has(rankKey);
    this.statsEl.replaceChildren(el('span', { class: 'note spinner' }, 'computing statistics'));
    this.statsEl.dataset.state = 'loading';
    try {
      const stats = await getJSON(`/api/checkpoints/${this.ck}/stats`, {
        name: rec.name, rank: this.rank, bins: 64, log: this.histLog ? 1 : 0, confirm: confirmed ? 1 : null,
      });
      if (seq !== this.statsSeq) return;
      if (confirmed) this.confirmed.add(rankKey);
      this.renderStats(stats);
      this.onStats(stats, { ck: this.ck, name: rec.name, rank: this.rank ?? null });
    } catch (err) {
      if (seq !== this.statsSeq) return;
      if (err.status === 409) this.renderOverBudget(err.body, rankKey);
      else {
        this.statsEl.dataset.state = 'error';
        this.statsEl.replaceChildren(el('span', { class: 'error-text' }, `Statistics failed: ${err.message}`));
      }
    }
  }

  renderOverBudget(body, rankKey) {
    const b = body.bytes ?? this.viewCost().bytes;
    const s = body.seconds ?? this.viewCost().seconds;
    this.statsEl.dataset.state = 'over-budget';
    const run = () => {
      // The user confirms seeing the size and time: a read above the budget is never silent.
      const ok = window.confirm(`Reading ${this.record.name} for statistics touches ${bytes(b)} (about ${seconds(s)}), above the read budget. Continue?`);
      if (ok) {
        this.confirmed.add(rankKey);
        this.loadStats({ confirm: true });
      }
    };
    this.statsEl.replaceChildren(
      el('p', { class: 'cost over' }, `Above the read budget: ${bytes(b)}, ~${seconds(s)}.`),
      el('button', { class: 'btn', type: 'button', 'data-testid': 'stats-compute', onclick: run }, 'Compute statistics…'));
  }

  renderStats(s) {
    this.statsEl.dataset.state = 'ready';
    const dd = (name, v, bad = false) => [el('dt', {}, name), el('dd', { 'data-stat': name, class: bad ? 'bad' : null }, v)];
    const grid = el('dl', { class: 'stats-grid' },
      ...dd('min', fmtValue(s.min, 6)), ...dd('max', fmtValue(s.max, 6)),
      ...dd('mean', fmtValue(s.mean, 6)), ...dd('std', fmtValue(s.std, 6)),
      ...dd('|max|', fmtValue(s.abs_max, 6)), ...dd('zeros', percent(s.zero_fraction)),
      ...dd('NaN', int(s.nans), s.nans > 0), ...dd('Inf', int(s.infs), s.infs > 0));
    this.statsData = s;
    const children = [grid];
    if (s.histogram && s.histogram.counts && s.histogram.counts.length) {
      const logX = el('input', { type: 'checkbox', 'data-testid': 'hist-log', checked: this.histLog });
      logX.addEventListener('change', () => { this.histLog = logX.checked; this.loadStats(); });
      const logY = el('input', { type: 'checkbox', 'data-testid': 'hist-log-count', checked: this.histLogY });
      logY.addEventListener('change', () => { this.histLogY = logY.checked; this.drawHistogram(); });
      this.histCanvas = el('canvas', { class: 'hist', 'data-testid': 'histogram' });
      this.histReadout = el('div', { class: 'hist-readout' }, '\u00a0');
      this.histCanvas.addEventListener('mousemove', (e) => this.histHover(e));
      this.histCanvas.addEventListener('mouseleave', () => { this.histReadout.textContent = '\u00a0'; });
      children.push(
        el('div', { class: 'hist-controls' },
          el('label', { title: 'Bins log-spaced on |x|' }, logX, ' log |x|'),
          el('label', { title: 'Bar heights on a log scale' }, logY, ' log count')),
        this.histCanvas, this.histReadout);
    }
    this.statsEl.replaceChildren(...children);
    if (this.histCanvas) requestAnimationFrame(() => this.drawHistogram());
  }

  drawHistogram() {
    const canvas = this.histCanvas;
    const h = this.statsData && this.statsData.histogram;
    if (!canvas || !h) return;
    const dpr = Math.min(2, window.devicePixelRatio || 1);
    const W = Math.max(100, canvas.clientWidth) * dpr;
    const H = Math.max(60, canvas.clientHeight) * dpr;
    canvas.width = W;
    canvas.height = H;
    const ctx = canvas.getContext('2d');
    ctx.clearRect(0, 0, W, H);
    const counts = h.counts;
    const padB = 16 * dpr;
    const plotH = H - padB;
    const tx = (c) => (this.histLogY ? Math.log10(1 + c) : c);
    const top = Math.max(1e-9, ...counts.map(tx));
    const bw = W / counts.length;
    ctx.fillStyle = '#4c78a8';
    counts.forEach((c, i) => {
      const bh = (tx(c) / top) * (plotH - 4 * dpr);
      ctx.fillRect(i * bw + 0.5, plotH - bh, Math.max(1, bw - 1), bh);
    });
    ctx.strokeStyle = '#b8c0cc';
    ctx.beginPath();
    ctx.moveTo(0, plotH + 0.5);
    ctx.lineTo(W, plotH + 0.5);
    ctx.stroke();
    // A zero line helps reading a weight histogram's skew.
    const e = h.edges;
    if (!this.histLog && e[0] < 0 && e[e.length - 1] > 0) {
      const x = ((0 - e[0]) / (e[e.length - 1] - e[0])) * W;
      ctx.strokeStyle = 'rgba(198, 47, 58, 0.7)';
      ctx.beginPath();
      ctx.moveTo(x + 0.5, 0);
      ctx.lineTo(x + 0.5, plotH);
      ctx.stroke();
    }
    ctx.fillStyle = '#4a5566';
    ctx.font = `${10 * dpr}px ui-monospace, Menlo, monospace`;
    ctx.textBaseline = 'bottom';
    ctx.textAlign = 'left';
    const prefix = this.histLog ? '|x| ' : '';
    ctx.fillText(prefix + fmtValue(e[0], 3), 2, H);
    ctx.textAlign = 'right';
    ctx.fillText(fmtValue(e[e.length - 1], 3), W - 2, H);
  }

  histHover(e) {
    const h = this.statsData && this.statsData.histogram;
    if (!h) return;
    const i = Math.floor((e.offsetX / this.histCanvas.clientWidth) * h.counts.length);
    if (i < 0 || i >= h.counts.length) return;
    const prefix = this.histLog ? '|x| in ' : '';
    this.histReadout.textContent = `${prefix}[${fmtValue(h.edges[i], 4)}, ${fmtValue(h.edges[i + 1], 4)}): ${int(h.counts[i])}`;
  }

  // ---------------------------------------------------------------- diff

  showDiff(rec) {
    this.record = null;
    this.chunkRows = null;
    const shapeText = (s) => (s ? fmtShape(s) : '–');
    const status = el('span', { class: `status ${rec.status}` }, statusLabel(rec.status));
    const sameName = rec.name_a === rec.name_b;
    const head = section('Difference',
      el('div', { class: 'insp-name' }, rec.name), el('div', { style: { margin: '4px 0' } }, status),
      facts([
        ['a', sameName ? null : rec.name_a],
        ['b', sameName ? null : rec.name_b],
        ['dtype', rec.dtype_a === rec.dtype_b ? rec.dtype_a : `${rec.dtype_a ?? '–'} → ${rec.dtype_b ?? '–'}`],
        ['shape', JSON.stringify(rec.shape_a) === JSON.stringify(rec.shape_b) ? shapeText(rec.shape_a) : `${shapeText(rec.shape_a)} → ${shapeText(rec.shape_b)}`],
      ]));
    const figures = section('Figures', el('dl', { class: 'stats-grid', 'data-testid': 'diff-figures' },
      el('dt', {}, 'max |a−b|'), el('dd', { 'data-stat': 'max_abs' }, fmtValue(rec.max_abs, 6)),
      el('dt', {}, 'max rel'), el('dd', { 'data-stat': 'max_rel' }, fmtValue(rec.max_rel, 6)),
      el('dt', {}, 'rel L2'), el('dd', { 'data-stat': 'rel_l2' }, fmtValue(rec.rel_l2, 6)),
      el('dt', {}, 'cosine'), el('dd', { 'data-stat': 'cosine' }, fmtValue(rec.cosine, 8)),
      el('dt', {}, 'mismatches'), el('dd', { 'data-stat': 'mismatches' }, `${int(rec.mismatches)} (${percent(rec.mismatch_fraction)})`),
      el('dt', {}, 'NaN vs num'), el('dd', { 'data-stat': 'nan_mismatches', class: rec.nan_mismatches ? 'bad' : null }, int(rec.nan_mismatches))));
    const parts = [head, figures];
    if (rec.worst_index) {
      parts.push(section('Worst element',
        facts([['index', `[${rec.worst_index.join(', ')}]`], ['a', fmtValue(rec.worst_a, 8)], ['b', fmtValue(rec.worst_b, 8)]]),
        el('button', { class: 'btn secondary', type: 'button', 'data-testid': 'goto-worst', style: { marginTop: '6px' },
          onclick: () => this.onFocusIndex(rec.worst_index) }, 'Show it in the heatmap')));
    }
    this.show(...parts);
  }

  message(text) {
    this.show(section('Inspector', el('p', { class: 'note' }, text)));
  }
}
