// The Architecture view: the folded module tree of /summary, or a flat tensor list, both drawn by a
// virtual scroller so that a 20,000-tensor checkpoint stays fast. A non-empty search switches to
// the flat list of matches.
//
// A folded node ("0..31", repeat 32) stands for identical siblings, and its children describe ONE
// instance. The row offers an instance picker; the children's paths are rewritten to the chosen
// instance, so the tensors you open are the real ones of that layer.

import { VirtualList } from './virtual.js';
import { bytes, count, dtypeColour, el, midName, shape as fmtShape, percent } from './format.js';

const ROW_HEIGHT = 26;

const DTYPE_ALIASES = {
  fp32: 'F32', float32: 'F32', float: 'F32', bf16: 'BF16', bfloat16: 'BF16', fp16: 'F16', float16: 'F16',
  fp64: 'F64', float64: 'F64', int64: 'I64', int32: 'I32', int16: 'I16', int8: 'I8', uint8: 'U8',
  fp8: 'F8_E4M3', e4m3: 'F8_E4M3', e5m2: 'F8_E5M2',
};

function globToRegExp(glob, { dim = false } = {}) {
  // In a shape glob "*" is one dimension ("4096x*" is 2-D); in a name glob it is any text.
  const any = dim ? '[^x]*' : '.*';
  const one = dim ? '[^x]' : '.';
  const body = glob.replace(/[.+^${}()|[\]\\]/g, '\\$&').replace(/\*/g, any).replace(/\?/g, one);
  return new RegExp(dim ? `^${body}$` : body, 'i');
}

/**
 * Compile a search query into a predicate over tensor records. Terms are ANDed. A term is a
 * shape glob when it looks like dims joined by "x"/"×" ("4096x*", "*x384"), a dtype when it names
 * one present in the checkpoint ("bf16", "F32"), a bare number ("384": a dimension of that size,
 * or the number in the name), else a name substring or glob. Prefixes name:, shape: and dtype: force
 * the kind.
 */
export function compileQuery(query, dtypesPresent) {
  const present = new Set(dtypesPresent.map((d) => d.toUpperCase()));
  const tests = [];
  for (const raw of query.trim().split(/\s+/).filter(Boolean)) {
    let [kind, term] = raw.includes(':') ? raw.split(/:(.*)/s) : [null, raw];
    if (kind && !['name', 'shape', 'dtype'].includes(kind)) [kind, term] = [null, raw];
    if (!term) continue;
    const shapeTerm = term.replace(/×/g, 'x').replace(/,/g, 'x').toLowerCase();
    const dtypeTerm = DTYPE_ALIASES[term.toLowerCase()] || term.toUpperCase();
    if (!kind && /^\d+$/.test(term)) {
      const n = Number(term);
      tests.push((t) => t.shape.includes(n) || t.name.includes(term));
      continue;
    }
    if (!kind) {
      if (/^[\d*?]+(x[\d*?]+)+$/.test(shapeTerm) || /^\*x?$/.test(shapeTerm)) kind = 'shape';
      else if (present.has(dtypeTerm)) kind = 'dtype';
      else kind = 'name';
    }
    if (kind === 'shape') {
      const re = globToRegExp(shapeTerm, { dim: true });
      tests.push((t) => re.test(t.shape.join('x')));
    } else if (kind === 'dtype') {
      tests.push((t) => t.dtype.toUpperCase() === dtypeTerm);
    } else if (/[*?]/.test(term)) {
      const re = globToRegExp(term);
      tests.push((t) => re.test(t.name));
    } else {
      const needle = term.toLowerCase();
      tests.push((t) => t.name.toLowerCase().includes(needle));
    }
  }
  return (t) => tests.every((test) => test(t));
}

/** The k largest tensors, largest first, ties in checkpoint order (a stable sort's first k, without sorting 20,000). */
export function largestTensors(tensors, k) {
  const top = [];
  for (const t of tensors) {
    if (top.length === k && t.nbytes <= top[k - 1].nbytes) continue;
    let i = top.length;
    while (i > 0 && top[i - 1].nbytes < t.nbytes) i--;
    top.splice(i, 0, t);
    if (top.length > k) top.pop();
  }
  return top;
}

/**
 * Rows whose badges do not fit beside the name take their short forms (S, F). In the tree they stay whole,
 * the (short) name giving way; in the flat list the long name keeps its room. All sizes are read before
 * any class is set (one layout).
 */
function compactTags(rows) {
  const crowded = rows.map((row) => row.querySelector('.tags')).filter((tags) => tags && tags.children.length
    && (tags.scrollHeight > tags.clientHeight + 1 || tags.scrollWidth > tags.clientWidth + 1));
  for (const tags of crowded) tags.classList.add('compact');
}

function foldRange(node) {
  const [first, last] = node.name.split('..').map(Number);
  return [first, last];
}

export class TreeView {
  /**
   * @param {{list: HTMLElement, status: HTMLElement, search: HTMLInputElement, modeToggle: HTMLElement,
   *          onSelect: (name: string) => void}} parts
   */
  constructor({ list, status, search, modeToggle, onSelect }) {
    this.listEl = list;
    this.statusEl = status;
    this.search = search;
    this.modeToggle = modeToggle;
    this.onSelect = onSelect;
    this.mode = 'tree';
    this.sort = 'order';
    this.query = '';
    this.expanded = new Set();  // original paths of expanded nodes
    this.instances = new Map();  // original path of a folded node -> chosen instance number
    this.rows = [];
    this.cursor = -1;
    this.selected = null;
    this.vlist = new VirtualList(list, { rowHeight: ROW_HEIGHT, render: (i) => this.renderRow(i), afterDraw: compactTags });

    let timer = 0;
    search.addEventListener('input', () => {
      clearTimeout(timer);
      timer = setTimeout(() => this.setQuery(search.value), 80);
    });
    modeToggle.addEventListener('click', (e) => {
      const button = e.target.closest('button[data-mode]');
      if (button) this.setMode(button.dataset.mode);
    });
    // From the search box, ↓ goes into the results and Enter opens the first (or the one under the cursor).
    search.addEventListener('keydown', (e) => {
      if (e.key !== 'ArrowDown' && e.key !== 'Enter') return;
      clearTimeout(timer);
      if (this.query !== search.value.trim()) this.setQuery(search.value);
      if (!this.rows.length) return;
      e.preventDefault();
      const row = e.key === 'Enter' ? this.rows[Math.max(0, this.cursor)] : this.rows[0];
      this.cursor = this.rows.indexOf(row);
      if (e.key === 'ArrowDown') list.focus({ preventScroll: true });
      this.activate(row, { toggleIfModule: true });
      this.vlist.scrollToIndex(this.cursor);
    });
    list.addEventListener('keydown', (e) => this.onKey(e));
    list.addEventListener('click', (e) => this.onClick(e));
  }

  setSummary(summary) {
    this.summary = summary;
    this.byName = new Map(summary.tensors.map((t) => [t.name, t]));
    this.total = summary.nbytes || 1;
    this.dtypesPresent = Object.keys(summary.totals_by_dtype || {});
    this.expanded.clear();
    this.instances.clear();
    // Open level after level while the whole first screen stays under ~40 rows, so that it shows
    // the model's structure (down to the folded block) rather than one collapsed root.
    let frontier = summary.tree.children.filter((c) => c.children.length);
    let rows = summary.tree.children.length;
    while (frontier.length) {
      const added = frontier.reduce((acc, n) => acc + n.children.length, 0);
      if (rows + added > 40 && rows > 1) break;
      rows += added;
      for (const n of frontier) this.expanded.add(n.path);
      frontier = frontier.flatMap((n) => n.children.filter((c) => c.children.length && c.repeat <= 1));
    }
    this.refresh();
  }

  setMode(mode) {
    this.mode = mode;
    for (const b of this.modeToggle.querySelectorAll('button')) b.classList.toggle('on', b.dataset.mode === mode);
    this.refresh();
  }

  setQuery(query) {
    if (this.search.value !== query) this.search.value = query;
    this.query = query.trim();
    this.refresh();
    this.listEl.scrollTop = 0;
    this.vlist.draw();
  }

  /** Rebuild the row model (tree flattening or list filtering), then redraw. */
  refresh() {
    if (!this.summary) return;
    const flat = this.mode === 'list' || this.query !== '';
    this.flat = flat;
    if (flat) {
      let tensors = this.summary.tensors;
      if (this.query) {
        const match = compileQuery(this.query, this.dtypesPresent);
        tensors = tensors.filter(match);
      }
      if (this.sort === 'size') tensors = [...tensors].sort((a, b) => b.nbytes - a.nbytes);
      else if (this.sort === 'name') tensors = [...tensors].sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
      this.rows = tensors.map((t) => ({ tensor: t, path: t.name }));
    } else {
      this.rows = this.flatten();
    }
    this.cursor = Math.min(this.cursor, this.rows.length - 1);
    this.renderStatus();
    this.vlist.setCount(this.rows.length);
  }

  flatten() {
    const rows = [];
    const walk = (node, depth, rewrite, parentBytes) => {
      for (const child of node.children) {
        const path = rewrite(child.path);
        const row = { node: child, depth, path, parentBytes };
        rows.push(row);
        if (child.children.length && this.expanded.has(child.path)) {
          let inner = rewrite;
          if (child.repeat > 1) {
            const [first] = foldRange(child);
            const k = this.instances.get(child.path) ?? first;
            const cut = path.lastIndexOf('.');
            const target = `${path.slice(0, cut + 1)}${k}`;
            inner = (p) => {
              const q = rewrite(p);
              return q === path || q.startsWith(`${path}.`) ? target + q.slice(path.length) : q;
            };
          }
          walk(child, depth + 1, inner, child.nbytes / (child.repeat || 1));
        }
      }
    };
    walk(this.summary.tree, 0, (p) => p, this.summary.tree.nbytes || this.total);
    return rows;
  }

  renderStatus() {
    const s = this.summary;
    if (this.flat) {
      const n = this.rows.length;
      const size = this.rows.reduce((acc, r) => acc + r.tensor.nbytes, 0);
      const sort = el('select', { 'aria-label': 'Sort', onchange: (e) => { this.sort = e.target.value; this.refresh(); } },
        el('option', { value: 'order', selected: this.sort === 'order' }, 'checkpoint order'),
        el('option', { value: 'size', selected: this.sort === 'size' }, 'largest first'),
        el('option', { value: 'name', selected: this.sort === 'name' }, 'by name'));
      const what = this.query ? `${n.toLocaleString('en-US')} of ${s.tensor_count.toLocaleString('en-US')} tensors match`
        : `${n.toLocaleString('en-US')} tensors`;
      this.statusEl.replaceChildren(el('span', { 'data-testid': 'match-count' }, `${what} · ${bytes(size)}`), sort);
    } else {
      this.statusEl.replaceChildren(el('span', {}, `${s.tensor_count.toLocaleString('en-US')} tensors · ${count(s.params)} params`),
        el('span', {},
          el('button', { class: 'linkish', type: 'button', onclick: () => this.expandAll(true), title: 'Expand every node' }, 'expand all'),
          ' ',
          el('button', { class: 'linkish', type: 'button', onclick: () => this.expandAll(false) }, 'collapse')));
    }
  }

  expandAll(open) {
    if (!open) {
      this.expanded.clear();
    } else {
      const walk = (node) => {
        for (const c of node.children) {
          if (c.children.length) { this.expanded.add(c.path); walk(c); }
        }
      };
      walk(this.summary.tree);
    }
    this.refresh();
  }

  dtypeMix(dtypes) {
    const entries = Object.entries(dtypes || {}).sort((a, b) => b[1] - a[1]);
    const total = entries.reduce((acc, [, v]) => acc + v, 0) || 1;
    return { entries, total, text: entries.map(([d]) => d).join('·'),
      title: entries.map(([d, v]) => `${d} ${percent(v / total)}`).join(' · ') };
  }

  sizeBar(nbytes, parentBytes, dtypes) {
    const share = Math.min(1, nbytes / (parentBytes || 1));
    const { entries, total } = this.dtypeMix(dtypes);
    const bar = el('span', { class: 'sizebar', style: { width: `${(share * 100).toFixed(2)}%` } });
    for (const [d, v] of entries) bar.append(el('i', { style: { width: `${(100 * v) / total}%`, background: dtypeColour(d) } }));
    return bar;
  }

  /** Badges; each has a long and a short text (S, F), the short one for a narrow list (style.css). */
  tags(sharded, multiFile, tensor) {
    const out = [];
    const text = (long, short) => [el('span', { class: 'long' }, long), el('span', { class: 'short' }, short)];
    if (sharded) out.push(el('span', { class: 'tag sharded', 'data-testid': 'badge-sharded', title: 'placement-sharded: split across ranks' }, text('sharded', 'S')));
    if (multiFile) out.push(el('span', { class: 'tag multifile', 'data-testid': 'badge-multi-file', title: 'spread over several files' }, text('files', 'F')));
    if (tensor && tensor.file_shard) {
      const [k, n] = tensor.file_shard;
      out.push(el('span', { class: 'tag shard', title: `file-level: shard ${k} of ${n} (${tensor.files[0]})` }, `${k}/${n}`));
    }
    return out;
  }

  renderRow(i) {
    const row = this.rows[i];
    const classes = ['row'];
    if (i === this.cursor) classes.push('cursor');
    if (this.flat) {
      const t = row.tensor;
      classes.push('flat');
      if (t.name === this.selected) classes.push('selected');
      const sharded = t.chunk_count > 1 && !t.file_shard;
      return el('div', { class: classes.join(' '), 'data-testid': 'tensor-row', 'data-name': t.name, 'data-index': i, title: `${t.name}\n${t.dtype} · ${t.split}` },
        el('span', { class: 'name', style: { paddingLeft: '10px' } },
          midName(t.name, 'label'), el('span', { class: 'tags' }, ...this.tags(sharded, t.files.length > 1, t))),
        el('span', { class: 'num' }, fmtShape(t.shape)),
        el('span', { class: 'num' }, bytes(t.nbytes)),
        el('span', { class: 'dt' }, t.dtype));
    }
    const node = row.node;
    const isTensor = node.tensor !== null && node.tensor !== undefined;
    const hasKids = node.children.length > 0;
    const open = hasKids && this.expanded.has(node.path);
    if (isTensor && row.path === this.selected) classes.push('selected');
    const mix = this.dtypeMix(node.dtypes);
    const label = el('span', { class: node.repeat > 1 ? 'label folded' : 'label' }, node.name || '(root)');
    if (isTensor) {
      label.dataset.testid = 'tensor-row';
      label.dataset.name = row.path;
    }
    const bits = [
      hasKids ? el('button', { class: 'toggle', type: 'button', 'data-testid': 'expand', 'aria-label': open ? 'Collapse' : 'Expand', tabindex: -1 }, open ? '▼' : '▶')
        : el('span', { class: 'spacer' }),
      label,
    ];
    if (node.repeat > 1) {
      bits.push(el('span', { class: 'repeat', title: `${node.repeat} identical blocks; the children describe one` }, `×${node.repeat}`));
      if (open) bits.push(this.instancePicker(node));
    }
    const tensorRecord = isTensor ? this.byName.get(row.path) : null;
    // Ancestors of split tensors would all carry the same tags: show them where they inform, on tensors
    // (their own record's: inside a folded layer that is the chosen instance's) and on collapsed modules.
    const tags = tensorRecord
      ? this.tags(tensorRecord.chunk_count > 1 && !tensorRecord.file_shard, tensorRecord.files.length > 1, tensorRecord)
      : this.tags(node.placement_sharded, node.multi_file, null);
    if (isTensor || !open) bits.push(el('span', { class: 'tags' }, ...tags));
    const shareTotal = percent(node.nbytes / this.total);
    return el('div', {
      class: classes.join(' '), 'data-testid': 'tree-node', 'data-path': row.path, 'data-index': i,
      role: 'treeitem', 'aria-level': row.depth + 1, 'aria-expanded': hasKids ? String(open) : null,
      title: `${row.path}${node.repeat > 1 ? ` (×${node.repeat})` : ''}\n${count(node.params)} params · ${bytes(node.nbytes)} · ${shareTotal} of checkpoint\n${mix.title}`,
    },
    el('span', { class: 'name', style: `--depth: ${row.depth}` }, ...bits),
    el('span', { class: 'num' }, isTensor ? fmtShape(node.tensor.shape) : count(node.params)),
    el('span', { class: 'num bytes' }, bytes(node.nbytes), this.sizeBar(node.nbytes, row.parentBytes, node.dtypes)),
    el('span', { class: 'dt', title: mix.title }, mix.text));
  }

  instancePicker(node) {
    const [first, last] = foldRange(node);
    const current = this.instances.get(node.path) ?? first;
    const attrs = { class: 'instance', title: 'instance shown below', 'data-testid': 'instance',
      onclick: (e) => e.stopPropagation(), onkeydown: (e) => e.stopPropagation(),
      onchange: (e) => this.setInstance(node, Number(e.target.value)) };
    if (last - first > 500) {
      return el('input', { ...attrs, type: 'number', min: first, max: last, value: current, style: { width: '64px' } });
    }
    const select = el('select', attrs);
    for (let k = first; k <= last; k++) select.append(el('option', { value: k, selected: k === current }, String(k)));
    return select;
  }

  setInstance(node, k) {
    const [first, last] = foldRange(node);
    if (!(k >= first && k <= last)) return;
    // The folded row's own path names its first instance; its children use the chosen one.
    const row = this.rows.find((r) => r.node === node);
    const base = row ? row.path.slice(0, row.path.lastIndexOf('.') + 1) : null;
    const oldPrefix = row ? `${base}${this.instances.get(node.path) ?? first}` : null;
    this.instances.set(node.path, k);
    this.refresh();
    // Follow the selection into the chosen instance: flipping through layers keeps the same weight.
    if (oldPrefix && this.selected && this.selected.startsWith(`${oldPrefix}.`)) {
      const name = `${base}${k}${this.selected.slice(oldPrefix.length)}`;
      if (this.byName.has(name)) this.onSelect(name);
    }
  }

  onClick(e) {
    if (e.target.closest('select, input')) return;
    const rowEl = e.target.closest('[data-index]');
    if (!rowEl) return;
    const i = Number(rowEl.dataset.index);
    this.cursor = i;
    const row = this.rows[i];
    if (e.target.closest('[data-testid="expand"]')) {
      this.toggle(row);
      return;
    }
    this.activate(row, { toggleIfModule: true });
    this.listEl.focus({ preventScroll: true });
  }

  activate(row, { toggleIfModule = false } = {}) {
    if (this.flat) {
      this.onSelect(row.tensor.name);
    } else if (row.node.tensor) {
      this.onSelect(row.path);
    } else if (toggleIfModule && row.node.children.length) {
      this.toggle(row);
      return;
    }
    this.vlist.draw();
  }

  toggle(row) {
    if (!row || this.flat || !row.node.children.length) return;
    if (this.expanded.has(row.node.path)) this.expanded.delete(row.node.path);
    else this.expanded.add(row.node.path);
    this.refresh();
  }

  onKey(e) {
    if (!this.rows.length) return;
    const row = this.rows[this.cursor];
    const move = (i) => {
      this.cursor = Math.max(0, Math.min(this.rows.length - 1, i));
      const target = this.rows[this.cursor];
      if (this.flat || target.node.tensor) this.activate(target);
      this.vlist.scrollToIndex(this.cursor);
    };
    switch (e.key) {
      case 'ArrowDown': move(this.cursor + 1); break;
      case 'ArrowUp': move(this.cursor - 1); break;
      case 'PageDown': move(this.cursor + 20); break;
      case 'PageUp': move(this.cursor - 20); break;
      case 'Home': move(0); break;
      case 'End': move(this.rows.length - 1); break;
      case 'ArrowRight':
        if (row && !this.flat && row.node.children.length && !this.expanded.has(row.node.path)) this.toggle(row);
        else move(this.cursor + 1);
        break;
      case 'ArrowLeft':
        if (row && !this.flat && this.expanded.has(row.node.path)) this.toggle(row);
        else if (row && !this.flat) {
          for (let i = this.cursor - 1; i >= 0; i--) {
            if (this.rows[i].depth < row.depth) { move(i); break; }
          }
        }
        break;
      case 'Enter': if (row) this.activate(row, { toggleIfModule: true }); break;
      default: return;
    }
    e.preventDefault();
    e.stopPropagation();
  }

  /** Mark a tensor selected, expanding its ancestors (and picking folded instances) to show it. */
  reveal(name) {
    this.selected = name;
    if (!this.summary) return;
    if (!this.flat) {
      const segments = name.split('.');
      let node = this.summary.tree;
      for (let i = 0; i < segments.length && node; i++) {
        const seg = segments[i];
        let next = node.children.find((c) => c.repeat <= 1 && c.name === seg);
        if (!next && /^\d+$/.test(seg)) {
          next = node.children.find((c) => {
            if (c.repeat <= 1) return false;
            const [first, last] = foldRange(c);
            return Number(seg) >= first && Number(seg) <= last;
          });
          if (next) this.instances.set(next.path, Number(seg));
        }
        if (!next) break;
        if (i < segments.length - 1) this.expanded.add(next.path);
        node = next;
      }
      this.refresh();
    }
    const index = this.rows.findIndex((r) => r.path === name);
    if (index >= 0) {
      this.cursor = index;
      this.vlist.scrollToIndex(index);
    } else {
      this.vlist.draw();
    }
  }
}
