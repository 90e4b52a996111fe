// "Go to" buttons: the first NaN or Inf (again: the next one), the largest |x|, the smallest and the largest
// value of the tensor on screen, or the largest |a − b| of a diff, found by the server's streamed search
// (docs/viewer-api.md, "search") with a progress bar and a cancel button. What is found is shown and pinned.

import { streamLines } from './api.js';
import { bytes, el, int, value as fmtValue } from './format.js';

const TENSOR_FINDS = [
  ['nan', 'NaN', 'Go to the first NaN (again: the next one)'],
  ['inf', 'Inf', 'Go to the first ±Inf (again: the next one)'],
  ['absmax', 'max |x|', 'Go to the largest |x| (reads the whole tensor)'],
  ['min', 'min', 'Go to the smallest value (reads the whole tensor)'],
  ['max', 'max', 'Go to the largest value (reads the whole tensor)'],
];
const DIFF_FINDS = [
  ['absdiff', 'max |a − b|', 'Go to the largest |a − b| (reads both tensors)'],
  ['nan', 'NaN', 'Go to the first NaN of a − b (again: the next one)'],
  ['inf', 'Inf', 'Go to the first ±Inf of a − b (again: the next one)'],
];
const NEXT = new Set(['nan', 'inf']);  // finds that step on to the next one when asked again
const WORDS = { nan: 'NaN', inf: 'Inf', absmax: 'max |x|', min: 'min', max: 'max', absdiff: 'max |a − b|' };

export class Finder {
  /**
   * box: the toolbar's find group. hooks: viewParams() (the heatmap's axes, so that the answer's view
   * matches what is shown), onFound(result) (show and pin result.index, result.view).
   */
  constructor(box, { viewParams, onFound }) {
    this.box = box;
    this.viewParams = viewParams;
    this.onFound = onFound;
    this.target = null;
    this.controller = null;
    this.setTarget(null);
  }

  /** target: {endpoint, params, diff} of the tensor on screen, or null. */
  setTarget(target) {
    this.cancel({ quiet: true });
    this.target = target;
    this.skip = {};  // find -> how many found already (for "next")
    this.counts = {};  // nan/inf counts from the statistics, when known
    this.box.hidden = !target;
    this.buttons = {};
    if (!target) {
      this.box.replaceChildren();
      return;
    }
    const finds = target.diff ? DIFF_FINDS : TENSOR_FINDS;
    this.progress = el('progress', { max: 1, value: 0, 'data-testid': 'find-progress', hidden: true });
    this.cancelButton = el('button', { type: 'button', class: 'linkish', 'data-testid': 'find-cancel', hidden: true,
      onclick: () => this.cancel() }, 'cancel');
    this.status = el('span', { class: 'find-status', 'data-testid': 'find-status' });
    this.box.replaceChildren(el('span', { class: 'muted' }, 'go to'),
      ...finds.map(([find, label, title]) => {
        this.buttons[find] = el('button', { type: 'button', 'data-testid': `find-${find}`, title, onclick: () => this.run(find) }, label);
        return this.buttons[find];
      }),
      this.progress, this.cancelButton, this.status);
  }

  /** NaN/Inf counts of the tensor's statistics: a find with none to find is disabled, and says so. */
  setCounts({ nans, infs }) {
    this.counts = { nan: nans, inf: infs };
    for (const [find, n] of Object.entries(this.counts)) {
      const button = this.buttons[find];
      if (!button || this.target.diff) continue;
      button.disabled = n === 0;
      button.title = n === 0 ? `No ${WORDS[find]} in this tensor (its statistics)` : `${TENSOR_FINDS.find(([f]) => f === find)[2]}: ${int(n)}`;
    }
  }

  cancel({ quiet = false } = {}) {
    if (!this.controller) return;
    this.controller.abort();
    this.controller = null;
    this.busy(false);
    if (!quiet) this.say('cancelled');
  }

  busy(on) {
    this.progress.hidden = !on;
    this.cancelButton.hidden = !on;
    for (const button of Object.values(this.buttons)) button.classList.remove('running');
    this.box.dataset.state = on ? 'running' : 'idle';
  }

  say(text, { error = false } = {}) {
    this.status.textContent = text;
    this.status.classList.toggle('error-text', error);
  }

  async run(find) {
    if (!this.target) return;
    this.cancel({ quiet: true });
    const controller = new AbortController();
    this.controller = controller;
    const skip = NEXT.has(find) ? this.skip[find] || 0 : 0;
    this.busy(true);
    this.progress.value = 0;
    this.buttons[find].classList.add('running');
    this.say(`looking for ${WORDS[find]}…`);
    const params = { ...this.target.params, ...this.viewParams(), find, skip: skip || null };
    let lines = 0;
    try {
      const result = await streamLines(this.target.endpoint, params, {
        signal: controller.signal,
        onLine: (line) => {
          if (!line.progress) return;
          this.box.dataset.progressLines = String(++lines);
          if (line.progress.total) this.progress.value = line.progress.bytes / line.progress.total;
        },
      });
      if (controller !== this.controller) return;
      this.controller = null;
      this.busy(false);
      const read = `${bytes(result.bytes_read)} read`;
      if (!result.found) {
        this.skip[find] = 0;
        this.say(`${skip ? 'no more' : 'no'} ${WORDS[find]} (${read})`);
        return;
      }
      if (NEXT.has(find)) this.skip[find] = skip + 1;
      const which = NEXT.has(find) ? ` #${skip + 1}` : '';
      const value = result.value === null ? '' : ` = ${fmtValue(result.value, 6)}`;  // NaN and ±Inf come as null
      this.say(`${WORDS[find]}${which} at [${result.index.join(', ')}]${value} (${read})`);
      this.box.dataset.found = result.index.join(',');
      await this.onFound(result);
    } catch (err) {
      if (err.name === 'AbortError' || controller !== this.controller) return;
      this.controller = null;
      this.busy(false);
      this.say(`search failed: ${err.message}`, { error: true });
    }
  }
}
