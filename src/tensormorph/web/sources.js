// What the heatmap shows, as its `source` (heatmap.js setSource): a tensor's full() or local(rank) view, or
// the difference of two aligned tensors, with the endpoints that serve its tiles.

/**
 * The shape of what `rank` holds, as the server's local view has it (core.local_tensor): its one
 * non-empty chunk's shape, the 1-D run of several chunks, or an empty chunk's shape.
 */
export function localShape(record, rank) {
  const numel = (c) => c.shape.reduce((a, b) => a * b, 1);
  const held = record.chunks.filter((c) => c.ranks.includes(rank));
  const full = held.filter((c) => numel(c) > 0);
  if (full.length > 1) return [full.reduce((n, c) => n + numel(c), 0)];
  const one = full[0] || held[0];
  return one ? one.shape : [0];
}

export function tensorSource(ck, record, rank) {
  return {
    record,
    tensorKey: `${ck}|${record.name}`,
    endpoint: `/api/checkpoints/${ck}/tile`,
    params: { name: record.name, rank },
    dims: rank === null ? record.shape : localShape(record, rank),  // the axes selector shows what is drawn
    chunks: rank === null ? record.chunks : null,
    probe: rank !== null,  // a local view's shape is the server's to say
    // local(rank) indices are within the rank's chunk: the hover readout adds its offsets
    indexOffset: rank === null ? null : (record.chunks.find((c) => c.ranks.includes(rank)) || {}).offsets || null,
  };
}

/** The source of a diff row: a − b (kind "diff") or |a − b| ("absdiff"); a pin reads both sides too. */
export function diffSource(rec, kind) {
  return {
    tensorKey: `diff|${rec.name}`,
    endpoint: '/api/diff/tile',
    params: { name: rec.name, kind },
    dims: rec.shape_a,
    chunks: null,
    probe: false,
    sides: [{ label: 'a', endpoint: '/api/checkpoints/a/tile', params: { name: rec.name_a } },
      { label: 'b', endpoint: '/api/checkpoints/b/tile', params: { name: rec.name_b } }],
  };
}
