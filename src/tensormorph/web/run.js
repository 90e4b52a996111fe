// The run panel (issue 18): a training run's steps, newest first, with the tiers that hold each (GET /api/run,
// listed afresh on every load: a live run changes, so the panel asks again while the run is alive). A step on
// disk or in the object store opens as checkpoint B beside the run's newest (A) through POST /api/run/open; a
// step only in memory is listed but cannot open: a memory snapshot holds one rank's shards.

import { ApiError, apiUrl, getJSON } from './api.js';
import { bytes, el, int } from './format.js';

const REFRESH_MS = 5000;  // how often a live run's listing is asked again
const MEMORY_ONLY = 'In memory only: each rank\'s snapshot holds that rank\'s shards alone, in this machine\'s '
  + 'shared memory. There is no checkpoint to open until the step reaches the disk or the object store.';

/** The tiers that hold a step, as chips: [[tier, label, tooltip, state], ...], fastest first. */
function tierChips(step, world) {
  const chips = [];
  const { ranks, copies, complete } = step.memory;
  const held = [...ranks, ...copies].sort((x, y) => x - y);
  if (held.length) {
    const where = `ranks ${ranks.join(', ') || '–'} in this machine's shared memory`
      + (copies.length ? `; ranks ${copies.join(', ')} as copies a peer holds` : '');
    if (!complete) {
      chips.push(['memory', `memory ${held.length}/${world} ranks`,
        `Incomplete: ${where}. A resume needs every rank's snapshot.`, 'partial']);
    } else {
      chips.push([copies.length ? 'peer' : 'memory', copies.length ? 'memory + peer copy' : 'memory',
        `Complete on all ${world} rank(s): ${where}.`, 'ok']);
    }
  }
  if (step.disk) chips.push(['disk', `disk ${bytes(step.disk.bytes)}`, `${step.disk.path}\nsaved ${when(step.disk.time)}`, 'ok']);
  if (step.remote) {
    chips.push(['remote', `object store ${bytes(step.remote.bytes)}`,
      `${step.remote.path}\nsaved ${when(step.remote.time)}`, 'ok']);
  }
  return chips;
}

function when(seconds) {
  return new Date(seconds * 1000).toLocaleString();
}

export class RunPanel {
  /**
   * @param {HTMLElement} box the panel's <details>
   * @param {{onOpened: (answer: {id, step, tier, path}) => Promise<void>}} hooks
   */
  constructor(box, { onOpened }) {
    Object.assign(this, { box, onOpened });
    this.listing = null;
    this.error = null;  // why the last listing or opening failed, shown in the panel
    this.served = [];  // /api/checkpoints: which step A and B are, by path
    this.timer = 0;
    this.opening = null;  // the step being opened
  }

  /** Ask for the listing; null when the viewer serves no run (the panel stays hidden). */
  async load() {
    clearTimeout(this.timer);
    try {
      const listing = await getJSON('/api/run');
      if (!listing) return null;
      this.listing = listing;
      this.error = null;
    } catch (err) {
      this.error = `Could not list the run: ${err.message}`;
    }
    this.render();
    if (this.listing && this.listing.alive) this.timer = setTimeout(() => this.load(), REFRESH_MS);
    return this.listing;
  }

  setServed(checkpoints) {
    this.served = checkpoints;
    if (this.listing) this.render();
  }

  /** The id that serves a step (A or B), from the paths of /api/checkpoints. */
  servedAs(step) {
    const paths = [step.disk && step.disk.path, step.remote && step.remote.path].filter(Boolean);
    const found = this.served.find((c) => paths.includes(c.path));
    return found ? found.id : null;
  }

  /** Open a step by its number (the Timeline's clicks); why it could not, or null once it is open. */
  async openStep(number) {
    const step = this.listing && this.listing.steps.find((s) => s.step === number);
    if (!step) return `Step ${int(number)} is not in the run's listing any more`;
    if (this.opening !== null) return `Step ${int(this.opening)} is still opening; try again when it has opened`;
    return (await this.open(step)) ? null : this.error;
  }

  /** Open a step as B (or show which of A and B serves it); whether it opened. */
  async open(step) {
    if (this.opening !== null) return false;
    this.opening = step.step;
    this.render();
    try {
      const url = apiUrl('/api/run/open', { step: step.step });
      const response = await fetch(url, { method: 'POST' });
      const body = await response.json().catch(() => ({ error: `${response.status} ${response.statusText}` }));
      if (!response.ok) throw new ApiError(response.status, body, url);
      this.error = null;
      await this.onOpened(body);
    } catch (err) {
      this.error = `Could not open step ${int(step.step)}: ${err.message}`;
    } finally {
      this.opening = null;
      this.render();
    }
    return this.error === null;
  }

  render() {
    const run = this.listing;
    const error = this.error ? el('div', { class: 'run-note error-text', 'data-testid': 'run-error' }, this.error) : null;
    this.box.hidden = false;
    if (!run) {
      this.box.replaceChildren(el('summary', {}, 'Run'), error || '');
      return;
    }
    const steps = [...run.steps].reverse();
    const memoryBytes = run.ranks.reduce((n, r) => n + r.bytes, 0);
    const head = el('div', { class: 'run-head' },
      el('span', { class: `run-alive${run.alive ? ' on' : ''}`, 'data-testid': 'run-alive',
        title: run.alive ? 'A process of the run holds its memory snapshots: the list refreshes every few seconds'
          : 'No process of the run is alive on this machine' }, run.alive ? 'live' : 'not running'),
      el('span', {}, `${int(run.world_size)} rank${run.world_size === 1 ? '' : 's'}`),
      run.ranks.length ? el('span', { title: run.memory_folder }, `${bytes(memoryBytes)} in memory`) : null,
      el('button', { type: 'button', class: 'run-refresh', title: 'List the steps again', 'data-testid': 'run-refresh',
        onclick: () => this.load() }, '↻'));
    const remote = run.remote_error
      ? el('div', { class: 'run-note error-text', 'data-testid': 'run-remote-error' }, `Object store not listed: ${run.remote_error}`)
      : null;
    const rows = steps.map((step) => this.row(step, run.world_size));
    const list = rows.length ? el('div', { class: 'run-steps', role: 'list', 'data-testid': 'run-steps' }, rows)
      : el('div', { class: 'run-note muted' }, 'No step saved yet.');
    const hint = steps.some((s) => s.disk || s.remote)
      ? el('div', { class: 'run-note muted' }, 'Click a step on disk or in the object store to open it as B; A ⇄ B compares.')
      : null;
    this.box.replaceChildren(...[
      el('summary', { title: run.run }, 'Run ', el('span', { class: 'muted' }, `· ${steps.length} step${steps.length === 1 ? '' : 's'}`)),
      el('div', { class: 'run-root mono', title: run.run }, run.run), head, remote, error, list, hint].filter(Boolean));
  }

  row(step, world) {
    const openable = Boolean(step.disk || step.remote);
    const id = this.servedAs(step);
    const chips = tierChips(step, world).map(([tier, label, tip, state]) => el('span', {
      class: `tier tier-${tier} ${state}`, 'data-tier': tier, title: tip }, label));
    const attrs = {
      class: `run-step${openable ? ' openable' : ''}${id ? ' served' : ''}`, role: 'listitem', 'data-testid': 'run-step',
      'data-step': step.step, 'data-tiers': step.tiers.join(' '), 'data-open': id || '',
      'aria-disabled': openable ? null : 'true',
      title: openable ? `Open step ${int(step.step)} ${step.disk ? 'from disk' : 'from the object store'}`
        + (id ? ` (shown as ${id.toUpperCase()})` : ' as B, beside the newest (A)') : MEMORY_ONLY,
    };
    const badge = el('span', { class: 'run-id' }, this.opening === step.step ? '…' : id ? id.toUpperCase() : '');
    const body = [badge, el('span', { class: 'run-num' }, int(step.step)), el('span', { class: 'tiers' }, chips)];
    if (!openable) return el('div', attrs, body);
    return el('button', { ...attrs, type: 'button', onclick: () => this.open(step) }, body);
  }
}
