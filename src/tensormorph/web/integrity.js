// The integrity panel of a checkpoint (docs/viewer-api.md, "Integrity panel"): every file, parity files and
// replicas included, with its size and CRC-32C; the parity stripes and what they protect; the objects (step,
// config ...) with their values; and a "verify" button that streams `tensormorph verify` with its progress
// and each problem as it is found.

import { getJSON, streamLines } from './api.js';
import { bytes, el, int } from './format.js';

const MAX_FILE_ROWS = 500;  // a checkpoint of more files lists the damaged ones first, then the first others
const MAX_PROBLEMS = 200;  // problems listed; the count says how many there were

function table(testid, head, rows) {
  return el('div', { class: 'chunks-wrap' }, el('table', { class: 'chunks', 'data-testid': testid },
    el('tr', {}, ...head.map((h) => el('th', {}, h))), ...rows));
}

function section(title, ...children) {
  return el('section', { class: 'insp-section' }, el('h3', {}, title), ...children);
}

export class IntegrityPanel {
  /** ck: the checkpoint id; summary: its /summary (the files listed until /integrity answers). */
  constructor(ck, summary) {
    this.ck = ck;
    this.files = section(`Files (${summary.files.length})`, table('files', ['file'], summary.files.slice(0, MAX_FILE_ROWS)
      .map((f) => el('tr', {}, el('td', {}, f)))));
    this.body = el('div', { 'data-testid': 'integrity', 'data-state': 'loading' }, el('span', { class: 'note spinner' }, 'reading'));
    this.integrity = section('Integrity', this.body);
    this.objects = el('div');
    this.sections = [this.integrity, this.files, this.objects];
    this.controller = null;
    this.load();
  }

  /** Stop a verify under way (the inspector shows something else). */
  close() {
    if (this.controller) this.controller.abort();
  }

  async load() {
    let info;
    try {
      info = await getJSON(`/api/checkpoints/${this.ck}/integrity`);
    } catch (err) {
      this.body.dataset.state = 'error';
      this.body.replaceChildren(el('span', { class: 'error-text' }, `Integrity unknown: ${err.message}`));
      return;
    }
    this.info = info;
    this.body.dataset.state = 'ready';
    this.renderSummary(info);
    this.renderFiles(info);
    this.renderObjects(info.objects || []);
  }

  renderSummary(info) {
    const damaged = Object.entries(info.damaged_files || {});
    const stripes = info.stripes || [];
    const lost = stripes.filter((s) => !s.recoverable).length + (info.replicas || []).filter((r) => r.recoverable === false).length;
    const verdict = !damaged.length ? el('b', { class: 'ok-text' }, 'every file present, sizes as recorded')
      : el('b', { class: lost ? 'error-text' : 'warn-text' },
        `${damaged.length} file${damaged.length === 1 ? '' : 's'} damaged: ${lost ? 'data lost' : 'recoverable (tensormorph repair)'}`);
    const facts = el('dl', { class: 'facts' },
      el('dt', {}, 'checksums'), el('dd', {}, info.checksum || 'none recorded'),
      el('dt', {}, 'redundancy'), el('dd', { 'data-testid': 'redundancy' }, info.redundancy || 'none'));
    this.verifyEl = el('div', { class: 'verify', 'data-testid': 'verify', 'data-state': 'idle' });
    const full = el('input', { type: 'checkbox', 'data-testid': 'verify-full' });
    this.button = el('button', { type: 'button', class: 'btn', 'data-testid': 'verify-button', onclick: () => this.verify(full.checked) }, 'Verify');
    this.body.replaceChildren(el('p', { 'data-testid': 'integrity-verdict' }, verdict),
      ...damaged.map(([name, why]) => el('div', { class: 'error-text mono', 'data-damaged': name }, `${name}: ${why}`)),
      facts, ...this.stripes(info),
      el('div', { class: 'verify-row' }, this.button, el('label', { title: 'Also read every value (NaN/Inf per tensor)' }, full, ' every value')),
      this.verifyEl);
  }

  /** One line per parity stripe or replicated file: what it protects, and its state. */
  stripes(info) {
    const state = (damaged, recoverable) => (damaged && damaged.length
      ? el('b', { class: recoverable ? 'warn-text' : 'error-text' }, ` ${damaged.length} damaged, ${recoverable ? 'recoverable' : 'lost'}`)
      : el('span', { class: 'ok-text' }, ' ok'));
    const out = [];
    if (info.stripes && info.stripes.length) {
      out.push(el('h4', {}, `Parity stripes (${info.stripes.length})`), el('ul', { class: 'stripes', 'data-testid': 'stripes' },
        ...info.stripes.map((s) => el('li', { 'data-stripe': s.index, title: [...s.data, ...s.parity].join('\n') },
          `#${s.index}: ${s.data.length} data + ${s.parity.length} parity files, protects ${bytes(s.protects)}, `
          + `survives ${s.tolerates} lost ·`, state(s.damaged, s.recoverable)))));
    }
    if (info.replicas && info.replicas.length) {
      out.push(el('h4', {}, `Replicas (${info.replicas.length} files)`), el('ul', { class: 'stripes', 'data-testid': 'replicas' },
        ...info.replicas.map((r) => el('li', { title: r.copies.join('\n') }, `${r.data}: ${r.copies.length} copies ·`,
          state(r.damaged, r.recoverable)))));
    }
    return out;
  }

  renderFiles(info) {
    const files = [...info.files].sort((a, b) => (a.status === 'ok') - (b.status === 'ok'));
    // the file cell holds its role and rank on a second line, so that the size and CRC columns fit
    const rows = files.slice(0, MAX_FILE_ROWS).map((f) => el('tr', { class: f.status === 'ok' ? null : 'bad', 'data-file': f.name, 'data-status': f.status },
      el('td', { class: 'file', title: f.name }, f.name,
        el('div', { class: 'muted' }, f.role, f.rank === null || f.rank === undefined ? '' : ` · rank ${f.rank}`)),
      el('td', { title: f.size === null ? '' : `${int(f.size)} bytes recorded, ${f.actual_size === null ? 'none' : int(f.actual_size)} on disk` },
        f.size === null ? '–' : bytes(f.size)),
      el('td', { class: 'mono' }, f.crc32c || '–'),
      el('td', {}, f.status === 'ok' ? 'ok' : f.status === 'missing' ? 'missing' : 'wrong size')));
    const more = files.length > MAX_FILE_ROWS ? el('div', { class: 'note' }, `… and ${int(files.length - MAX_FILE_ROWS)} more`) : null;
    const parity = files.filter((f) => f.role === 'parity' || f.role === 'replica').length;
    this.files.replaceChildren(el('h3', {}, `Files (${files.length}${parity ? `, ${parity} ${files.find((f) => f.role === 'replica') ? 'replica' : 'parity'}` : ''})`),
      table('files', ['file', 'size', 'CRC-32C', 'state'], rows), ...(more ? [more] : []));
  }

  renderObjects(objects) {
    if (!objects.length) return;
    this.objects.replaceChildren(section(`Objects (${objects.length})`, table('objects', ['object', 'type', 'value'],
      objects.map((o) => el('tr', { 'data-object': o.name },
        el('td', {}, o.name), el('td', {}, o.type || '–'),
        el('td', { class: 'value', title: o.preview || '' }, o.preview || '–'))))));
  }

  /** Stream verify: progress, each problem as found, then the verdict. */
  async verify(full) {
    this.close();
    const controller = new AbortController();
    this.controller = controller;
    const progress = el('progress', { max: 1, value: 0 });
    const line = el('div', { class: 'note', 'data-testid': 'verify-progress' }, 'starting');
    const problems = el('ul', { class: 'problems', 'data-testid': 'verify-problems' });
    let found = 0;
    const cancel = el('button', { type: 'button', class: 'linkish', onclick: () => controller.abort() }, 'cancel');
    this.verifyEl.dataset.state = 'running';
    this.verifyEl.replaceChildren(el('div', { class: 'verify-row' }, progress, cancel), line, problems);
    this.button.disabled = true;
    try {
      const done = await streamLines(`/api/checkpoints/${this.ck}/verify`, { full: full ? 1 : null }, {
        signal: controller.signal,
        onLine: (msg) => {
          if (msg.progress) {
            const p = msg.progress;
            if (p.total_bytes) progress.value = p.bytes / p.total_bytes;
            line.textContent = `${int(p.checked)} checked · ${p.item || ''}`;
          } else if (msg.problem) {
            found += 1;
            if (found <= MAX_PROBLEMS) {
              const p = msg.problem;
              const file = p.file ? p.file.split(/[\\/]/).pop() : null;
              problems.append(el('li', { 'data-kind': p.kind, 'data-file': file || '', title: p.file || '' },
                el('b', {}, file || p.tensor || p.kind), ` ${p.message}`));
            }
          }
        },
      });
      progress.value = 1;
      this.verifyEl.dataset.state = done.ok ? 'ok' : 'problems';
      line.className = done.ok ? 'ok-text' : 'error-text';
      line.textContent = done.ok
        ? `OK: ${int(done.checked)} items, ${int(done.checksums_checked)} checksums checked, ${bytes(done.bytes_read)} read`
        : `${int(done.problems)} problem${done.problems === 1 ? '' : 's'} (${int(done.checksums_checked)} checksums checked)`;
    } catch (err) {
      this.verifyEl.dataset.state = err.name === 'AbortError' ? 'cancelled' : 'error';
      line.className = 'error-text';
      line.textContent = err.name === 'AbortError' ? 'cancelled' : `verify failed: ${err.message}`;
    } finally {
      cancel.remove();
      this.button.disabled = false;
      if (this.controller === controller) this.controller = null;
    }
  }
}
