// The HTTP API of docs/viewer-api.md: JSON helpers that forward the access token, and the parser
// of the binary tile format. Nothing here touches the DOM, so the parser can be tested in Node.

/** The token the server printed, read once from the page's own URL (?token=...). */
const TOKEN = typeof location !== 'undefined' ? new URLSearchParams(location.search).get('token') : null;

/** An error answer of the API, with its status and JSON body kept for callers (409 carries costs). */
export class ApiError extends Error {
  constructor(status, body, url) {
    super((body && body.error) || `HTTP ${status}`);
    this.status = status;
    this.body = body || {};
    this.url = url;
  }
}

/** URL of an API path with query parameters; null/undefined parameters are left out. */
export function apiUrl(path, params = {}) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value === null || value === undefined || value === '') continue;
    query.set(key, Array.isArray(value) ? value.join(',') : String(value));
  }
  if (TOKEN) query.set('token', TOKEN);
  const qs = query.toString();
  return qs ? `${path}?${qs}` : path;
}

async function failure(response, url) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = { error: `${response.status} ${response.statusText}` };
  }
  return new ApiError(response.status, body, url);
}

/** The answer ({value}, or null when it failed) that index.html asked for early to GET `path`, handed out once. */
function early(path) {
  const asked = typeof window !== 'undefined' ? window.tensormorphEarly : null;
  const answer = asked && asked[path];
  if (!answer) return null;
  delete asked[path];
  return answer;
}

/** The page has started: later calls ask afresh (a run's step may have replaced a checkpoint since). */
export function forgetEarly() {
  if (typeof window !== 'undefined') window.tensormorphEarly = null;
}

export async function getJSON(path, params, { signal } = {}) {
  const asked = params && Object.keys(params).length ? null : early(path);
  const got = asked && await asked;
  if (got) return got.value;  // a failed early answer is asked again here, to fail with the server's error
  const url = apiUrl(path, params);
  const response = await fetch(url, { signal });
  if (!response.ok) throw await failure(response, url);
  return response.json();
}

/**
 * A tile ({header, fields, scale}): asked byte-plane shuffled, which compresses better on the wire. scale is
 * the tensor's whole finite range {min, max, absmax} from the X-Tensormorph-Scale header, or null.
 */
export async function getTile(path, params, { signal } = {}) {
  const url = apiUrl(path, { ...params, shuffle: 1 });
  const response = await fetch(url, { signal });
  if (!response.ok) throw await failure(response, url);
  const tile = parseTile(await response.arrayBuffer());
  const scale = response.headers.get('X-Tensormorph-Scale');
  tile.scale = scale ? JSON.parse(scale) : null;
  return tile;
}

/**
 * Read an NDJSON stream (search, verify): onLine(object) for each line; resolves with the last line, the
 * {"done": true, ...} one. An {"error"} line rejects; so does abort() through `signal`.
 */
export async function streamLines(path, params, { signal, onLine = () => {} } = {}) {
  const url = apiUrl(path, params);
  const response = await fetch(url, { signal });
  if (!response.ok) throw await failure(response, url);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let pending = '';
  let last = null;
  const take = (line) => {
    if (!line.trim()) return;
    last = JSON.parse(line);
    if (last.error) throw new ApiError(response.status, last, url);
    onLine(last);
  };
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    const lines = pending.split('\n');
    pending = lines.pop();
    lines.forEach(take);
  }
  take(pending + decoder.decode());
  if (!last || !last.done) throw new ApiError(response.status, { error: 'the answer ended early' }, url);
  return last;
}

const LITTLE_ENDIAN_HOST = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;

/** A float32 LE array stored byte-plane by byte-plane (byte b of element i at b·count + i), put back. */
function unshuffle(planes, count) {
  const bytes = new Uint8Array(count * 4);
  for (let b = 0; b < 4; b++) {
    const plane = b * count;
    for (let i = 0; i < count; i++) bytes[i * 4 + b] = planes[plane + i];
  }
  if (LITTLE_ENDIAN_HOST) return new Float32Array(bytes.buffer);
  const view = new DataView(bytes.buffer);
  const array = new Float32Array(count);
  for (let i = 0; i < count; i++) array[i] = view.getFloat32(i * 4, true);
  return array;
}

/**
 * Parse a tile: u32 LE header length n, n bytes of JSON, then one float32 LE array of
 * rows × cols per entry of header.fields, row-major (byte-plane shuffled when header.shuffle).
 * Returns {header, fields: {name: Float32Array}}.
 */
export function parseTile(buffer) {
  if (buffer.byteLength < 4) throw new Error(`tile of ${buffer.byteLength} bytes has no header length`);
  const view = new DataView(buffer);
  const n = view.getUint32(0, true);
  if (4 + n > buffer.byteLength) throw new Error(`tile header of ${n} bytes overruns ${buffer.byteLength} bytes`);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, n)));
  const [rows, cols] = header.shape;
  const count = rows * cols;
  const expected = 4 + n + header.fields.length * count * 4;
  if (buffer.byteLength !== expected) {
    throw new Error(`tile of ${buffer.byteLength} bytes, expected ${expected} for ${header.fields.length} ` +
      `field(s) of ${rows}×${cols}`);
  }
  const fields = {};
  let offset = 4 + n;
  for (const name of header.fields) {
    let array;
    if (header.shuffle) {
      array = unshuffle(new Uint8Array(buffer, offset, count * 4), count);
    } else if (LITTLE_ENDIAN_HOST) {
      // slice() copies into a fresh buffer: the data after the JSON need not be 4-byte aligned.
      array = new Float32Array(buffer.slice(offset, offset + count * 4));
    } else {
      array = new Float32Array(count);
      for (let i = 0; i < count; i++) array[i] = view.getFloat32(offset + i * 4, true);
    }
    fields[name] = array;
    offset += count * 4;
  }
  return { header, fields };
}
