// The view in the URL hash, so that a link or a history entry brings back exactly what was on screen:
//   #ck=a&t=NAME&rank=R&axes=0,2&fixed=3&zoom=0.5&at=120.5,300&cmap=diverging&norm=symmetric&agg=auto
//    &clip=1&lock=1&pin=4,120,300                       (a tensor of checkpoint a)
//   #ck=diff&t=NAME&kind=absdiff&...                    (the diff view of a − b or |a − b|)
//   #ck=timeline                                        (a training run's Timeline page, timeline.js)
// zoom is CSS pixels per element (absent: fit the whole view), at the view element at the canvas centre
// (row, column), pin the tensor index of a pinned element. The query string is the server's (?token=...).
// Pure functions: nothing here touches the page.

import { COLORMAPS, NORMALISATIONS } from './colormaps.js';

const SETTING_KEYS = ['cmap', 'norm', 'agg', 'clip'];
const SUMMARIES = ['auto', 'mean', 'absmax', 'min', 'max'];
const own = (table, key) => Object.prototype.hasOwnProperty.call(table, key);
// what a setting from a link may be: anything else (a typo, `constructor`) is left out, never drawn with
const VALID = {
  cmap: (v) => own(COLORMAPS, v),
  norm: (v) => own(NORMALISATIONS, v),
  agg: (v) => SUMMARIES.includes(v),
  clip: (v) => Number.isFinite(v) && v >= 0 && v < 50,
};
const ZOOM_DIGITS = 4;  // significant digits of a zoom in the URL: well below a pixel on any screen
const AT_PIXEL_DIGITS = 3;  // the centre to 1/1000 of a pixel at the link's zoom, so text lands where it was

function numbers(text) {
  if (text === null || text === '') return null;
  const list = text.split(',').map(Number);
  return list.every(Number.isFinite) ? list : null;
}

function integers(text) {
  const list = numbers(text);
  return list && list.every((n) => Number.isInteger(n) && n >= 0) ? list : null;
}

/** Read a hash ("#ck=a&t=..."); anything malformed is left out, never an error. */
export function parseRoute(hash) {
  const p = new URLSearchParams(hash.replace(/^#/, ''));
  const rank = p.get('rank');
  const zoom = Number(p.get('zoom'));
  const at = numbers(p.get('at'));
  const settings = {};
  for (const key of SETTING_KEYS) {
    if (!p.has(key)) continue;
    const value = key === 'clip' ? Number(p.get(key)) : p.get(key);
    if (VALID[key](value)) settings[key] = value;
  }
  if (p.has('lock')) settings.lock = p.get('lock') === '1';
  const kind = p.get('kind');
  return {
    ck: p.get('ck'),
    t: p.get('t'),
    rank: rank !== null && /^\d+$/.test(rank) ? Number(rank) : null,
    kind: kind === 'diff' || kind === 'absdiff' ? kind : null,
    view: {
      axes: integers(p.get('axes')),
      fixed: integers(p.get('fixed')),
      zoom: zoom > 0 ? zoom : null,
      at: at && at.length === 2 ? at : null,
      pin: integers(p.get('pin')),
    },
    settings,
  };
}

/**
 * The hash of a route: {ck, t, rank, kind, view: {axes, fixed, zoom, at, pin}, settings}. Members that
 * are null or missing are left out; the order of the keys is fixed, so one view has one URL.
 */
export function formatRoute({ ck, t, rank = null, kind = null, view = null, settings = null }) {
  const p = new URLSearchParams();
  if (ck) p.set('ck', ck);
  if (t) p.set('t', t);
  if (rank !== null && rank !== undefined) p.set('rank', String(rank));
  if (kind) p.set('kind', kind);
  if (view) {
    if (view.axes) p.set('axes', view.axes.join(','));
    if (view.fixed && view.fixed.length) p.set('fixed', view.fixed.join(','));
    if (view.zoom) p.set('zoom', String(Number(view.zoom.toPrecision(ZOOM_DIGITS))));
    if (view.at) {
      const decimals = Math.max(0, Math.min(12, Math.ceil(Math.log10(view.zoom || 1)) + AT_PIXEL_DIGITS));
      p.set('at', view.at.map((v) => String(Number(v.toFixed(decimals)))).join(','));
    }
  }
  if (t && settings) {
    for (const key of SETTING_KEYS) {
      if (settings[key] === undefined || (key === 'clip' && settings.norm !== 'clip')) continue;
      p.set(key, String(settings[key]));
    }
    if (settings.lock) p.set('lock', '1');
  }
  if (view && view.pin) p.set('pin', view.pin.join(','));
  return `#${p.toString().replace(/%2C/g, ',')}`;  // commas need no escape in a fragment: keep links readable
}

/** The Plan page of checkpoint `ck` (a checkpoint that is only a config.json offers nothing else); `search`: the
 * page's query string, whose token travels with it. */
export function planPage(ck, search) {
  return `plan.html${search}#ck=${encodeURIComponent(ck)}`;
}

/** A word for the shell: quoted unless it is made of characters no shell treats specially. */
export function shellWord(text) {
  const s = String(text);
  return /^[\w./:=@%+-]+$/.test(s) ? s : `'${s.replace(/'/g, "'\\''")}'`;
}

/**
 * The `tensormorph show` command line that prints `index` of tensor `name` in checkpoint `path`: index is a
 * list of numbers (one element) or [start, stop] pairs (a region), one per dimension; rank: local(rank).
 */
export function showCommand(path, name, index, rank = null) {
  const parts = ['tensormorph', 'show', shellWord(path), shellWord(name)];
  if (index.length) {
    const text = index.map((d) => (Array.isArray(d) ? `${d[0]}:${d[1]}` : String(d))).join(', ');
    parts.push('--slice', shellWord(text));
  }
  if (rank !== null && rank !== undefined) parts.push('--rank', String(rank));
  return parts.join(' ');
}
