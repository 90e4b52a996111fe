// The Diff view: the table of /api/diff (logical tensors compared, never shard bytes), sortable by
// column and filterable by status and name, drawn by the virtual scroller. Choosing a row shows
// a − b or |a − b| in the heatmap (app.js wires that to /api/diff/tile).

import { getJSON } from './api.js';
import { VirtualList } from './virtual.js';
import { el, int, midName, percent, shape as fmtShape, value as fmtValue } from './format.js';

const NAME_MIN_PX = 120;  // the name column is never dragged narrower than this

const STATUS_ORDER = ['different', 'shape_mismatch', 'dtype_mismatch', 'only_a', 'only_b', 'close', 'equal'];

/** Short labels for the narrow status column (data-status keeps the API's own word). */
const STATUS_LABELS = {
  different: 'different', shape_mismatch: 'shape ≠', dtype_mismatch: 'dtype ≠', only_a: 'only in a', only_b: 'only in b',
  close: 'close', equal: 'equal',
};

export function statusLabel(status) {
  return STATUS_LABELS[status] || status;
}

const COLUMNS = [
  { key: 'status', label: 'status', numeric: false },
  { key: 'name', label: 'name', numeric: false },
  { key: 'shape', label: 'shape', numeric: false },
  { key: 'max_abs', label: 'max |Δ|', numeric: true },
  { key: 'rel_l2', label: 'rel L2', numeric: true },
  { key: 'cosine', label: 'cosine', numeric: true },
  { key: 'mismatch_fraction', label: 'mism.', numeric: true },
];

function shapeOf(t) {
  const a = t.shape_a ? fmtShape(t.shape_a) : null;
  const b = t.shape_b ? fmtShape(t.shape_b) : null;
  if (a && b && a !== b) return `${a}→${b}`;
  return a || b || '–';
}

export class DiffView {
  /** @param {HTMLElement} root  @param {{onSelect: (rec: object) => void}} hooks */
  constructor(root, { onSelect }) {
    this.root = root;
    this.onSelect = onSelect;
    this.report = null;
    this.rows = [];
    this.sort = null;  // {key, asc}; null keeps the server's order (worst first)
    this.statuses = new Set();  // empty: all
    this.nameFilter = '';
    this.selected = null;
    this.atol = 0;
    this.rtol = 0;
    this.build();
  }

  build() {
    this.summaryEl = el('div', { class: 'diff-summary' }, 'Comparing…');
    this.chipsEl = el('div', { class: 'chips' });
    const name = el('input', { type: 'search', placeholder: 'Filter by name', 'data-testid': 'diff-filter', 'aria-label': 'Filter by name' });
    let timer = 0;
    name.addEventListener('input', () => {
      clearTimeout(timer);
      timer = setTimeout(() => { this.nameFilter = name.value.trim().toLowerCase(); this.refresh(); }, 80);
    });
    const atol = el('input', { type: 'number', min: 0, step: 'any', value: 0, title: 'absolute tolerance', 'data-testid': 'diff-atol' });
    const rtol = el('input', { type: 'number', min: 0, step: 'any', value: 0, title: 'relative tolerance', 'data-testid': 'diff-rtol' });
    const apply = () => {
      this.atol = Number(atol.value) || 0;
      this.rtol = Number(rtol.value) || 0;
      this.load();
    };
    atol.addEventListener('change', apply);
    rtol.addEventListener('change', apply);
    this.headerEl = el('div', { class: 'drow header', role: 'row' });
    this.listEl = el('div', { class: 'vlist', tabindex: 0, 'aria-label': 'Differences' });
    this.objectsEl = el('div', { class: 'objects', hidden: true });
    // The header and the rows scroll sideways together when the name column is wider than the pane.
    this.tableEl = el('div', { class: 'diff-table', 'data-testid': 'diff-table' }, this.headerEl, this.listEl);
    this.root.replaceChildren(
      el('div', { class: 'diff-head' }, this.summaryEl, this.chipsEl,
        el('div', { class: 'diff-filters' }, name, el('label', {}, 'atol ', atol), el('label', {}, 'rtol ', rtol))),
      this.tableEl, this.objectsEl);
    this.vlist = new VirtualList(this.listEl, { rowHeight: 26, render: (i) => this.renderRow(i) });
    this.renderHeader();
    this.listEl.addEventListener('click', (e) => {
      const row = e.target.closest('[data-index]');
      if (row) this.choose(Number(row.dataset.index));
    });
    this.listEl.addEventListener('keydown', (e) => {
      const i = this.rows.findIndex((t) => t.name === this.selected);
      if (e.key === 'ArrowDown') this.choose(Math.min(this.rows.length - 1, i + 1));
      else if (e.key === 'ArrowUp') this.choose(Math.max(0, i - 1));
      else return;
      e.preventDefault();
      e.stopPropagation();
    });
  }

  async load() {
    this.summaryEl.textContent = 'Comparing logical tensors…';
    this.summaryEl.classList.add('spinner');
    try {
      this.report = await getJSON('/api/diff', { atol: this.atol || null, rtol: this.rtol || null });
    } catch (err) {
      this.summaryEl.classList.remove('spinner');
      this.summaryEl.replaceChildren(el('span', { class: 'error-text' }, `Diff failed: ${err.message}`));
      return null;
    }
    this.summaryEl.classList.remove('spinner');
    this.renderSummary();
    this.refresh();
    return this.report;
  }

  renderSummary() {
    const r = this.report;
    const n = r.tensors.length;
    const verdict = r.identical ? el('b', { class: 'ok' }, 'identical') : el('b', { class: 'ko' }, 'different');
    this.summaryEl.replaceChildren(verdict, ` · ${int(n)} tensors compared`,
      r.atol || r.rtol ? ` · atol ${r.atol}, rtol ${r.rtol}` : '', r.renames && r.renames.length ? ` · renames: ${r.renames.join('; ')}` : '');
    this.chipsEl.replaceChildren();
    for (const status of STATUS_ORDER) {
      const k = (r.counts || {})[status];
      if (!k) continue;
      const chip = el('button', { type: 'button', class: `chip${this.statuses.has(status) ? ' on' : ''}`, 'data-testid': `diff-chip-${status}`, 'data-status': status,
        title: 'Show only this status (click again to clear)' }, el('span', { class: `status ${status}` }, statusLabel(status)), ` ${int(k)}`);
      chip.addEventListener('click', () => {
        if (this.statuses.has(status)) this.statuses.delete(status);
        else this.statuses.add(status);
        this.renderSummary();
        this.refresh();
      });
      this.chipsEl.append(chip);
    }
    if (r.objects && r.objects.length) {
      const changed = r.objects.filter((o) => o.status !== 'equal');
      this.objectsEl.hidden = false;
      this.objectsEl.replaceChildren(el('b', {}, `Other objects: ${r.objects.length}, ${changed.length} not equal`),
        ...changed.slice(0, 200).map((o) => el('div', {}, el('span', { class: `status ${o.status}` }, o.status), ` ${o.name} `, el('span', { class: 'muted' }, o.detail || ''))));
    } else {
      this.objectsEl.hidden = true;
    }
  }

  /** Give the name column `px` pixels (null: the room the pane leaves, at least the default minimum). */
  setNameWidth(px) {
    this.nameWidth = px === null ? null : Math.max(NAME_MIN_PX, Math.round(px));
    const style = this.tableEl.style;
    if (this.nameWidth === null) {
      style.removeProperty('--diff-name-col');
      style.removeProperty('--diff-row-min');
    } else {
      style.setProperty('--diff-name-col', `${this.nameWidth}px`);
      style.setProperty('--diff-row-min', `calc(var(--diff-fixed) + ${this.nameWidth}px)`);
    }
  }

  /** The handle on the name column's right edge: drag to resize, double-click to give the pane's room back. */
  resizeHandle() {
    const handle = el('span', { class: 'col-resize', 'data-testid': 'diff-name-resize', title: 'Drag to resize the name column; double-click to reset',
      role: 'separator', 'aria-orientation': 'vertical' });
    handle.addEventListener('click', (e) => e.stopPropagation());
    handle.addEventListener('dblclick', (e) => { e.stopPropagation(); this.setNameWidth(null); });
    handle.addEventListener('pointerdown', (e) => {
      e.preventDefault();
      e.stopPropagation();
      const start = e.clientX;
      const width = handle.parentElement.getBoundingClientRect().width;
      handle.setPointerCapture(e.pointerId);
      const move = (ev) => this.setNameWidth(width + ev.clientX - start);
      const up = () => {
        handle.removeEventListener('pointermove', move);
        handle.removeEventListener('pointerup', up);
      };
      handle.addEventListener('pointermove', move);
      handle.addEventListener('pointerup', up);
    });
    return handle;
  }

  renderHeader() {
    this.headerEl.replaceChildren(...COLUMNS.map((c) => {
      const sorted = this.sort && this.sort.key === c.key;
      const span = el('span', { class: `${c.numeric ? 'num ' : ''}${sorted ? `sorted${this.sort.asc ? ' asc' : ''}` : ''}`,
        'data-testid': `diff-sort-${c.key}`, role: 'columnheader', title: 'Sort' }, c.label);
      span.addEventListener('click', () => {
        if (sorted) this.sort = { key: c.key, asc: !this.sort.asc };
        else this.sort = { key: c.key, asc: !c.numeric };
        this.renderHeader();
        this.refresh();
      });
      if (c.key === 'name') span.append(this.resizeHandle());
      return span;
    }));
  }

  refresh() {
    if (!this.report) return;
    let rows = this.report.tensors;
    if (this.statuses.size) rows = rows.filter((t) => this.statuses.has(t.status));
    if (this.nameFilter) rows = rows.filter((t) => t.name.toLowerCase().includes(this.nameFilter));
    if (this.sort) {
      const { key, asc } = this.sort;
      const value = (t) => (key === 'status' ? STATUS_ORDER.indexOf(t.status) : key === 'shape' ? shapeOf(t) : t[key]);
      rows = [...rows].sort((x, y) => {
        const a = value(x);
        const b = value(y);
        // Missing figures (only_a, mismatched shapes) go last whatever the direction.
        if (a === null || a === undefined) return b === null || b === undefined ? 0 : 1;
        if (b === null || b === undefined) return -1;
        const cmp = a < b ? -1 : a > b ? 1 : 0;
        return asc ? cmp : -cmp;
      });
    }
    this.rows = rows;
    this.vlist.setCount(rows.length);
  }

  renderRow(i) {
    const t = this.rows[i];
    const num = (v, digits) => el('span', { class: 'num' }, v === null || v === undefined ? '–' : fmtValue(v, digits));
    return el('div', {
      class: `drow body${t.name === this.selected ? ' selected' : ''}`, 'data-testid': 'diff-row', 'data-name': t.name,
      'data-status': t.status, 'data-index': i, role: 'row', title: t.name,
    },
    el('span', {}, el('span', { class: `status ${t.status}` }, statusLabel(t.status))),
    midName(t.name, 'mono'),
    el('span', { class: 'mono' }, shapeOf(t)),
    num(t.max_abs, 3), num(t.rel_l2, 3), num(t.cosine, 6),
    el('span', { class: 'num' }, t.mismatches ? percent(t.mismatch_fraction) : '0'));
  }

  choose(i) {
    const t = this.rows[i];
    if (!t) return;
    this.selected = t.name;
    this.vlist.scrollToIndex(i);
    this.onSelect(t);
  }

  /** Select by name (from the URL). */
  select(name) {
    this.selected = name;
    const i = this.rows.findIndex((t) => t.name === name);
    if (i >= 0) this.vlist.scrollToIndex(i);
    return this.report ? this.report.tensors.find((t) => t.name === name) : null;
  }
}
