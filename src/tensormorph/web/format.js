// Number and text formatting shared by the views.

const BYTE_UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

export function bytes(n) {
  if (n === null || n === undefined) return '–';
  let i = 0;
  let v = n;
  while (v >= 1024 && i < BYTE_UNITS.length - 1) { v /= 1024; i++; }
  return i === 0 ? `${v} B` : `${v < 10 ? v.toFixed(2) : v < 100 ? v.toFixed(1) : v.toFixed(0)} ${BYTE_UNITS[i]}`;
}

/** Parameter counts the way model cards write them: 22.7M, 6.7B. */
export function count(n) {
  if (n === null || n === undefined) return '–';
  const units = [[1e12, 'T'], [1e9, 'B'], [1e6, 'M'], [1e3, 'k']];
  for (const [size, unit] of units) {
    if (n >= size) {
      const v = n / size;
      return `${v < 10 ? v.toFixed(2) : v < 100 ? v.toFixed(1) : v.toFixed(0)}${unit}`;
    }
  }
  return String(n);
}

const INTEGER = new Intl.NumberFormat('en-US');  // one formatter: toLocaleString makes one per call (~50 µs each)

export function int(n) {
  return n === null || n === undefined ? '–' : INTEGER.format(Number(n));
}

/** A tensor value: short but never misleading (exponent form for very small/large magnitudes). */
export function value(v, digits = 5) {
  if (v === null || v === undefined) return '–';
  if (Number.isNaN(v)) return 'NaN';
  if (v === Infinity) return '+Inf';
  if (v === -Infinity) return '-Inf';
  if (v === 0) return '0';
  const a = Math.abs(v);
  if (Number.isInteger(v) && a < 1e9) return String(v);
  if (a >= 1e5 || a < 1e-3) return v.toExponential(digits - 1).replace(/\.?0+e/, 'e');
  return String(Number(v.toPrecision(digits)));
}

/** Even shorter, for text drawn inside heatmap cells. */
export function cell(v) {
  if (Number.isNaN(v)) return 'NaN';
  if (!Number.isFinite(v)) return v > 0 ? '+Inf' : '-Inf';
  if (v === 0) return '0';
  const a = Math.abs(v);
  if (Number.isInteger(v) && a < 1e5) return String(v);
  if (a >= 1e4 || a < 1e-2) return v.toExponential(1).replace('e-', 'e−');
  return String(Number(v.toPrecision(3)));
}

export function shape(dims) {
  return dims && dims.length ? dims.join('×') : 'scalar';
}

export function seconds(s) {
  if (s === null || s === undefined) return '–';
  if (s < 0.001) return '<1 ms';
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  return `${(s / 60).toFixed(1)} min`;
}

export function percent(f) {
  if (f === null || f === undefined) return '–';
  if (f === 0) return '0%';
  if (f < 0.001) return '<0.1%';
  return `${(f * 100).toFixed(f < 0.1 ? 1 : 0)}%`;
}

/** Stable colour per dtype for the dtype-mix bars. */
const DTYPE_COLOURS = {
  F32: '#4c78a8', BF16: '#f58518', F16: '#e45756', F64: '#72b7b2', F8_E4M3: '#b279a2', F8_E5M2: '#9d755d',
  I64: '#54a24b', I32: '#88d27a', I16: '#bab0ac', I8: '#eeca3b', U8: '#ff9da6', BOOL: '#79706e',
};

export function dtypeColour(dtype) {
  if (DTYPE_COLOURS[dtype]) return DTYPE_COLOURS[dtype];
  let h = 0;
  for (const ch of dtype) h = (h * 31 + ch.charCodeAt(0)) % 360;
  return `hsl(${h} 45% 55%)`;
}

/** Create an element: el('div', {class: 'x', dataset: {k: v}}, child, 'text'). */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, val] of Object.entries(attrs)) {
    if (val === null || val === undefined || val === false) continue;
    if (key === 'class') node.className = val;
    else if (key === 'dataset') Object.assign(node.dataset, val);
    else if (key === 'style' && typeof val === 'object') Object.assign(node.style, val);
    else if (key.startsWith('on') && typeof val === 'function') node.addEventListener(key.slice(2), val);
    else if (key === 'text') node.textContent = val;
    else node.setAttribute(key, val === true ? '' : val);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const MID_TAIL_MIN_CH = 12;  // the end of a cut name keeps at least this many characters (or all of it)

/**
 * Where a long name is cut, [index, numbered]: right after its last numeric segment (the layer
 * number, as in "model.encoder.layer.11" | ".attention.self.query.weight"; numbered true), else at
 * the separator nearest the middle.
 */
export function nameSplit(name) {
  let at = -1;
  for (const m of name.matchAll(/(?:^|[._/-])\d+(?=[._/-]|$)/g)) at = m.index + m[0].length;
  if (at > 0 && at < name.length) return [at, true];
  const half = Math.floor(name.length / 2);
  const before = Math.max(name.lastIndexOf('.', half), name.lastIndexOf('/', half));
  const sep = before > 0 ? before : name.indexOf('.', half);
  return [sep > 0 ? sep : half, false];
}

/**
 * A name that, in a box too narrow for it, is cut in the middle rather than at an end: the part after
 * nameSplit() gives way first (cut at its start), down to MID_TAIL_MIN_CH characters, then the start:
 * "model.encoder.layer.11…self.query.weight", then "…coder.layer.11…query.weight" (a start that ends
 * with the layer number is cut at its own start, so the number stays). CSS only (.midname in
 * style.css), so it follows any resize; the text content is the whole name and the title shows it.
 * `cls`: more classes for the outer span.
 */
export function midName(name, cls = '') {
  const s = String(name);
  const [at, numbered] = nameSplit(s);
  const tail = s.slice(at);
  const node = el('span', { class: ['midname', numbered ? 'numbered' : '', cls].filter(Boolean).join(' '), title: s },
    el('span', { class: 'mid-head' }, el('bdi', {}, s.slice(0, at))), el('span', { class: 'mid-tail' }, el('bdi', {}, tail)));
  node.style.setProperty('--tail-min', `${Math.min(tail.length, MID_TAIL_MIN_CH)}ch`);
  return node;
}
