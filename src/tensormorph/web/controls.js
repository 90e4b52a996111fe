// The heatmap's toolbar: display settings (aggregation, colour map, normalisation, clip), the zoom
// buttons, and the axes choice for N-D tensors (which dimensions are rows and columns, and the
// index along each of the others).

import { COLORMAP_LABELS, NORMALISATIONS } from './colormaps.js';
import { resolveAgg } from './render.js';

const AGG_LABELS = { absmax: 'abs-max', mean: 'mean', min: 'min', max: 'max' };

/**
 * Fill and wire the settings controls. parts: the elements (aggSelect, cmapSelect, normSelect,
 * clipInput, lockInput, zoomInButton, zoomOutButton, zoomFitButton); actions: set(changes), zoomBy(f), fit().
 */
export function bindSettingsControls(parts, settings, { set, zoomBy, fit }) {
  for (const [name, label] of Object.entries(COLORMAP_LABELS)) parts.cmapSelect.append(new Option(label, name));
  for (const [name, label] of Object.entries(NORMALISATIONS)) parts.normSelect.append(new Option(label, name));
  syncSettingsControls(parts, settings);
  parts.aggSelect.addEventListener('change', () => set({ agg: parts.aggSelect.value }));
  parts.cmapSelect.addEventListener('change', () => set({ cmap: parts.cmapSelect.value }));
  parts.normSelect.addEventListener('change', () => set({ norm: parts.normSelect.value }));
  parts.lockInput.addEventListener('change', () => set({ lock: parts.lockInput.checked }));
  parts.clipInput.addEventListener('input', () => {
    const v = Number(parts.clipInput.value);
    if (v >= 0 && v < 50) set({ clip: v });
  });
  parts.zoomInButton.addEventListener('click', () => zoomBy(2));
  parts.zoomOutButton.addEventListener('click', () => zoomBy(0.5));
  parts.zoomFitButton.addEventListener('click', () => fit());
}

/**
 * Show `settings` in the controls (the clip input only with the clip normalisation); rangeKnown: whether
 * the tensor's global range is known, without which the scale cannot be locked to it.
 */
export function syncSettingsControls(parts, settings, rangeKnown = false) {
  parts.aggSelect.options[0].textContent = `auto: ${AGG_LABELS[resolveAgg({ ...settings, agg: 'auto' })]}`;
  parts.aggSelect.value = settings.agg;
  parts.lockInput.checked = Boolean(settings.lock);
  parts.lockInput.disabled = !rangeKnown && !settings.lock;
  parts.lockWrap.title = rangeKnown ? "Colour scale from the tensor's global min and max (its statistics), not the tiles on screen"
    : "The tensor's statistics are not known yet (or were not computed): the scale follows the tiles on screen";
  parts.cmapSelect.value = settings.cmap;
  parts.normSelect.value = settings.norm;
  parts.clipInput.value = settings.clip;
  parts.clipWrap.hidden = settings.norm !== 'clip';
}

/**
 * Rows/cols selects and one index input per other dimension, into `box`; empty for a slice of
 * fewer than two dimensions or null. onAxes(): the axes changed (the fixed indices were reset);
 * onFixed(): a fixed index changed.
 */
export function renderAxesControls(box, slice, { onAxes, onFixed }) {
  box.replaceChildren();
  if (!slice || slice.dims.length < 2) return;
  const { dims } = slice;
  const nd = dims.length;
  const dimSelect = (which) => {
    const select = document.createElement('select');
    select.dataset.testid = which === 0 ? 'axis-rows' : 'axis-cols';
    dims.forEach((n, d) => select.append(new Option(`d${d} (${n})`, d)));
    select.value = slice.axes[which];
    select.addEventListener('change', () => {
      slice.chooseAxis(which, Number(select.value));
      onAxes();
    });
    return select;
  };
  const rows = document.createElement('label');
  rows.append('rows', dimSelect(0));
  const cols = document.createElement('label');
  cols.append('cols', dimSelect(1));
  box.append(rows, cols);
  let k = 0;
  for (let d = 0; d < nd; d++) {
    if (slice.axes.includes(d)) continue;
    const index = k++;
    const label = document.createElement('label');
    label.title = `index along dimension ${d} (0..${dims[d] - 1})`;
    const input = document.createElement('input');
    input.type = 'number';
    input.min = 0;
    input.max = Math.max(0, dims[d] - 1);
    input.value = slice.fixed[index];
    input.dataset.testid = `fixed-${d}`;
    input.addEventListener('change', () => {
      const v = Math.max(0, Math.min(dims[d] - 1, Math.floor(Number(input.value) || 0)));
      input.value = v;
      slice.fixed[index] = v;
      onFixed();
    });
    label.append(`d${d}=`, input);
    box.append(label);
  }
}
