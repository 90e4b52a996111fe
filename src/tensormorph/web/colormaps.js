// Colour maps and value normalisation, applied entirely in the browser: changing either
// recolours the tiles already fetched and never makes a request.
//
// The tables are matplotlib's, sampled at 256 points and stored as hex so that the page needs no
// data files and no network.

const HEX = {
  viridis:
    '44015444025645045745055946075a46085c460a5d460b5e470d60470e61471063471164471365481467481668481769' +
    '48186a481a6c481b6d481c6e481d6f481f70482071482173482374482475482576482677482878482979472a7a472c7a' +
    '472d7b472e7c472f7d46307e46327e46337f463480453581453781453882443983443a83443b84433d84433e85423f85' +
    '4240864241864142874144874045884046883f47883f48893e49893e4a893e4c8a3d4d8a3d4e8a3c4f8a3c508b3b518b' +
    '3b528b3a538b3a548c39558c39568c38588c38598c375a8c375b8d365c8d365d8d355e8d355f8d34608d34618d33628d' +
    '33638d32648e32658e31668e31678e31688e30698e306a8e2f6b8e2f6c8e2e6d8e2e6e8e2e6f8e2d708e2d718e2c718e' +
    '2c728e2c738e2b748e2b758e2a768e2a778e2a788e29798e297a8e297b8e287c8e287d8e277e8e277f8e27808e26818e' +
    '26828e26828e25838e25848e25858e24868e24878e23888e23898e238a8d228b8d228c8d228d8d218e8d218f8d21908d' +
    '21918c20928c20928c20938c1f948c1f958b1f968b1f978b1f988b1f998a1f9a8a1e9b8a1e9c891e9d891f9e891f9f88' +
    '1fa0881fa1881fa1871fa28720a38620a48621a58521a68522a78522a88423a98324aa8325ab8225ac8226ad8127ad81' +
    '28ae8029af7f2ab07f2cb17e2db27d2eb37c2fb47c31b57b32b67a34b67935b77937b87838b9773aba763bbb753dbc74' +
    '3fbc7340bd7242be7144bf7046c06f48c16e4ac16d4cc26c4ec36b50c46a52c56954c56856c66758c7655ac8645cc863' +
    '5ec96260ca6063cb5f65cb5e67cc5c69cd5b6ccd5a6ece5870cf5773d05675d05477d1537ad1517cd2507fd34e81d34d' +
    '84d44b86d54989d5488bd6468ed64590d74393d74195d84098d83e9bd93c9dd93ba0da39a2da37a5db36a8db34aadc32' +
    'addc30b0dd2fb2dd2db5de2bb8de29bade28bddf26c0df25c2df23c5e021c8e020cae11fcde11dd0e11cd2e21bd5e21a' +
    'd8e219dae319dde318dfe318e2e418e5e419e7e419eae51aece51befe51cf1e51df4e61ef6e620f8e621fbe723fde725',
  magma:
    '00000401000501010601010802010902020b02020d03030f03031204041405041606051806051a07061c08071e090720' +
    '0a08220b09240c09260d0a290e0b2b100b2d110c2f120d31130d34140e36150e38160f3b180f3d19103f1a10421c1044' +
    '1d11471e114920114b21114e22115024125325125527125829115a2a115c2c115f2d11612f1163311165331067341069' +
    '36106b38106c390f6e3b0f703d0f713f0f72400f74420f75440f764510774710784910784a10794c117a4e117b4f127b' +
    '51127c52137c54137d56147d57157e59157e5a167e5c167f5d177f5f187f601880621980641a80651a80671b80681c81' +
    '6a1c816b1d816d1d816e1e81701f81721f817320817521817621817822817922827b23827c23827e2482802582812581' +
    '8326818426818627818827818928818b29818c29818e2a81902a81912b81932b80942c80962c80982d80992d809b2e7f' +
    '9c2e7f9e2f7fa02f7fa1307ea3307ea5317ea6317da8327daa337dab337cad347cae347bb0357bb2357bb3367ab5367a' +
    'b73779b83779ba3878bc3978bd3977bf3a77c03a76c23b75c43c75c53c74c73d73c83e73ca3e72cc3f71cd4071cf4070' +
    'd0416fd2426fd3436ed5446dd6456cd8456cd9466bdb476adc4869de4968df4a68e04c67e24d66e34e65e44f64e55064' +
    'e75263e85362e95462ea5661eb5760ec5860ed5a5fee5b5eef5d5ef05f5ef1605df2625df2645cf3655cf4675cf4695c' +
    'f56b5cf66c5cf66e5cf7705cf7725cf8745cf8765cf9785df9795df97b5dfa7d5efa7f5efa815ffb835ffb8560fb8761' +
    'fc8961fc8a62fc8c63fc8e64fc9065fd9266fd9467fd9668fd9869fd9a6afd9b6bfe9d6cfe9f6dfea16efea36ffea571' +
    'fea772fea973feaa74feac76feae77feb078feb27afeb47bfeb67cfeb77efeb97ffebb81febd82febf84fec185fec287' +
    'fec488fec68afec88cfeca8dfecc8ffecd90fecf92fed194fed395fed597fed799fed89afdda9cfddc9efddea0fde0a1' +
    'fde2a3fde3a5fde5a7fde7a9fde9aafdebacfcecaefceeb0fcf0b2fcf2b4fcf4b6fcf6b8fcf7b9fcf9bbfcfbbdfcfdbf',
  // matplotlib's RdBu reversed: blue (negative) - white (zero) - red (positive)
  diverging:
    '05306106326407346708366a09386d0a3b700c3d730d3f760e41790f437b10457e114781124984134c87144e8a15508d' +
    '1752901854931956961a58991b5a9c1c5c9f1d5fa21e61a51f63a82065ab2267ac2369ad246aae266caf276eb02870b1' +
    '2a71b22b73b32c75b42e77b52f79b5307ab6327cb7337eb83480b93681ba3783bb3885bc3a87bd3b88be3c8abe3e8cbf' +
    '3f8ec0408fc14291c24393c34695c44997c54c99c64f9bc7529dc8569fc959a1ca5ca3cb5fa5cd62a7ce65a9cf68abd0' +
    '6bacd16eaed271b0d375b2d478b4d57bb6d67eb8d781bad884bcd987beda8ac0db8dc2dc90c4dd93c6de96c7df98c8e0' +
    '9bc9e09dcbe1a0cce2a2cde3a5cee3a7d0e4a9d1e5acd2e5aed3e6b1d5e7b3d6e8b6d7e8b8d8e9bbdaeabddbeac0dceb' +
    'c2ddecc5dfecc7e0edcae1eecce2efcfe4efd1e5f0d2e6f0d4e6f1d5e7f1d7e8f1d8e9f1dae9f2dbeaf2ddebf2deebf2' +
    'e0ecf3e1edf3e3edf3e4eef4e6eff4e7f0f4e9f0f4eaf1f5ecf2f5edf2f5eff3f5f0f4f6f2f5f6f3f5f6f5f6f7f6f7f7' +
    'f7f6f6f7f5f4f8f4f2f8f3f0f8f2eff8f1edf9f0ebf9efe9f9eee7f9ede5f9ebe3faeae1fae9dffae8defae7dcfbe6da' +
    'fbe5d8fbe4d6fbe3d4fce2d2fce0d0fcdfcffcdecdfdddcbfddcc9fddbc7fdd9c4fcd7c2fcd5bffcd3bcfbd0b9fbceb7' +
    'fbccb4facab1fac8aff9c6acf9c4a9f9c2a7f8bfa4f8bda1f8bb9ef7b99cf7b799f7b596f6b394f6b191f6af8ef5ac8b' +
    'f5aa89f5a886f4a683f3a481f2a17ff19e7df09c7bef9979ee9677ec9374eb9172ea8e70e98b6ee8896ce6866ae58368' +
    'e48066e37e64e27b62e17860df765ede735cdd7059dc6e57db6b55da6853d86551d7634fd6604dd55d4cd35a4ad25849' +
    'd05548cf5246ce4f45cc4c44cb4942c94741c84440c6413ec53e3dc43b3cc2383ac13639bf3338be3036bd2d35bb2a34' +
    'ba2832b82531b72230b61f2eb41c2db3192cb1182bae172aab162aa81529a51429a213289f12289c1127991027960f27' +
    '930e26900d268d0c258a0b25870a248409248108237f08237c07227906227605217304217003206d02206a011f67001f',
  cividis:
    '00224e00234f00245100255300255400265600275800285900285b00295d002a5f002a61002b62002c64002c66002d68' +
    '002e6a002e6c002f6d00306f0030700031700031710132710533710833700c34700f357012357014367016377018376f' +
    '1a386f1c396f1e3a6f203a6f213b6e233c6e243c6e263d6e273e6e293f6e2a3f6d2b406d2d416d2e416d2f426d31436d' +
    '32436d33446d34456c35456c36466c38476c39486c3a486c3b496c3c4a6c3d4a6c3e4b6c3f4c6c404c6c414d6c424e6c' +
    '434e6c444f6c45506c46516c47516c48526c49536c4a536c4b546c4c556c4d556c4e566c4f576c50576c51586d52596d' +
    '535a6d545a6d555b6d555c6d565c6d575d6d585e6d595e6e5a5f6e5b606e5c616e5d616e5e626e5e636f5f636f60646f' +
    '61656f62656f636670646770656870656870666970676a71686a71696b716a6c716b6d726c6d726c6e726d6f726e6f73' +
    '6f70737071737172747272747273747374757474757575757676767777767777777878777979777a7a787b7a787c7b78' +
    '7d7c787e7c787e7d787f7e78807f78817f788280798381798482798582798683798784788885788985788a86788b8778' +
    '8c88788d88788e89788f8a78908b78918b78928c78928d78938e78948e77958f779690779791779892779992779a9376' +
    '9b94769c95769d95769e96769f9775a09875a19975a29975a39a74a49b74a59c74a69c74a79d73a89e73a99f73aaa073' +
    'aba072aca172ada272aea371afa471b0a571b1a570b3a670b4a76fb5a86fb6a96fb7a96eb8aa6eb9ab6dbaac6dbbad6d' +
    'bcae6cbdae6cbeaf6bbfb06bc0b16ac1b26ac2b369c3b369c4b468c5b568c6b667c7b767c8b866c9b965cbb965ccba64' +
    'cdbb63cebc63cfbd62d0be62d1bf61d2c060d3c05fd4c15fd5c25ed6c35dd7c45cd9c55cdac65bdbc75adcc859ddc858' +
    'dec958dfca57e0cb56e1cc55e2cd54e4ce53e5cf52e6d051e7d150e8d24fe9d34eead34cebd44bedd54aeed649efd748' +
    'f0d846f1d945f2da44f3db42f5dc41f6dd3ff7de3ef8df3cf9e03afbe138fce236fde334fee434fee535fee636fee838',
};

function decode(hex) {
  const lut = new Uint8Array(256 * 3);
  for (let i = 0; i < 256 * 3; i++) lut[i] = parseInt(hex.substr(i * 2, 2), 16);
  return lut;
}

function grey() {
  const lut = new Uint8Array(256 * 3);
  for (let i = 0; i < 256; i++) lut[i * 3] = lut[i * 3 + 1] = lut[i * 3 + 2] = i;
  return lut;
}

/** name -> Uint8Array(768) of RGB triples. */
export const COLORMAPS = {
  viridis: decode(HEX.viridis),
  magma: decode(HEX.magma),
  diverging: decode(HEX.diverging),
  grey: grey(),
  cividis: decode(HEX.cividis),
};

export const COLORMAP_LABELS = {
  viridis: 'viridis', magma: 'magma', diverging: 'blue-white-red', grey: 'grey', cividis: 'cividis',
};

/** Colours of NaN and ±Inf cells: hues none of the maps use, so they are never mistaken for a value. */
export const NAN_RGB = [255, 0, 200];
export const INF_RGB = [0, 232, 255];

/** Bits of a tile's "nonfinite" field (docs/viewer-api.md): the block holds a NaN, a +Inf, a −Inf. */
export const FLAG_NAN = 1;
export const FLAG_INF = 2 | 4;

/** The colour of a flagged pixel (NaN wins over Inf), or null for an all-finite block. */
export function flagRgb(flags) {
  if (flags & FLAG_NAN) return NAN_RGB;
  return flags & FLAG_INF ? INF_RGB : null;
}

export const NORMALISATIONS = {
  linear: 'linear',
  symmetric: 'symmetric ±',
  log: 'log |x|',
  clip: 'percentile clip',
};

/** The q-quantile (0..1) of the finite values, estimated on at most 65536 samples. */
function quantiles(values, qs) {
  const n = values.length;
  const stride = Math.max(1, Math.floor(n / 65536));
  const sample = [];
  for (let i = 0; i < n; i += stride) {
    const v = values[i];
    if (Number.isFinite(v)) sample.push(v);
  }
  if (!sample.length) return qs.map(() => NaN);
  const sorted = Float64Array.from(sample).sort();
  return qs.map((q) => sorted[Math.min(sorted.length - 1, Math.max(0, Math.round(q * (sorted.length - 1))))]);
}

/**
 * Build the mapping value -> [0, 1] for one array under a normalisation.
 * range: {lo, hi} to use instead of the values' own finite min and max (the scale locked to the
 * tensor's global range); the percentile clip then gives way to it.
 * Returns {map(v) -> t or NaN, lo, hi, label} where lo/hi are the values at the ends of the bar.
 */
export function makeNormaliser(values, mode, { clipPercent = 1, range = null } = {}) {
  let lo = Infinity;
  let hi = -Infinity;
  if (range) {
    ({ lo, hi } = range);
  } else {
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (Number.isFinite(v)) {
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
    }
  }
  if (lo === Infinity) { lo = 0; hi = 0; }
  const linear = (a, b) => {
    const span = b - a;
    if (!(span > 0)) return { map: (v) => (v > a ? 1 : v < a ? 0 : 0.5), lo: a, hi: b };
    return { map: (v) => (v - a) / span, lo: a, hi: b };
  };
  if (mode === 'symmetric') {
    const m = Math.max(Math.abs(lo), Math.abs(hi));
    return { ...linear(-m, m), mode };
  }
  if (mode === 'clip' && !range) {
    const [a, b] = quantiles(values, [clipPercent / 100, 1 - clipPercent / 100]);
    return { ...linear(Number.isNaN(a) ? lo : a, Number.isNaN(b) ? hi : b), mode };
  }
  if (mode === 'log') {
    // Smallest non-zero magnitude, but never more than 12 decades below the largest, so that
    // one denormal does not squash the whole map.
    let maxAbs = Math.max(Math.abs(lo), Math.abs(hi));
    let minAbs = Infinity;
    for (let i = 0; i < values.length; i++) {
      const a = Math.abs(values[i]);
      if (a > 0 && a < minAbs && Number.isFinite(a)) minAbs = a;
    }
    if (!(maxAbs > 0)) return { map: () => 0, lo: 0, hi: 0, mode, log: true };
    minAbs = Math.max(minAbs === Infinity ? maxAbs : minAbs, maxAbs * 1e-12);
    const l0 = Math.log10(minAbs);
    const span = Math.log10(maxAbs) - l0;
    return {
      map: (v) => {
        const a = Math.abs(v);
        if (a === 0) return 0;
        return span > 0 ? (Math.log10(a) - l0) / span : 1;
      },
      lo: minAbs, hi: maxAbs, mode, log: true,
    };
  }
  return { ...linear(lo, hi), mode: 'linear' };
}

/**
 * Paint values into RGBA pixels (an ImageData's data) through a normaliser and a colour map. flags: the
 * tile's "nonfinite" field or null; a flagged pixel takes the NaN/Inf colour whatever its summary says,
 * so a block holding one NaN among millions of values shows at any zoom.
 */
export function paint(values, rgba, normaliser, lut, flags = null) {
  const { map } = normaliser;
  for (let i = 0, p = 0; i < values.length; i++, p += 4) {
    const v = values[i];
    const special = flags && flags[i] ? flagRgb(flags[i]) : Number.isNaN(v) ? NAN_RGB : Number.isFinite(v) ? null : INF_RGB;
    if (special) {
      rgba[p] = special[0]; rgba[p + 1] = special[1]; rgba[p + 2] = special[2];
    } else {
      let t = map(v);
      t = t < 0 ? 0 : t > 1 ? 1 : t;
      const k = ((t * 255 + 0.5) | 0) * 3;
      rgba[p] = lut[k]; rgba[p + 1] = lut[k + 1]; rgba[p + 2] = lut[k + 2];
    }
    rgba[p + 3] = 255;
  }
}

/** CSS colour of one value, for text contrast and the legend. */
export function rgbOf(t, lut) {
  const k = ((Math.min(1, Math.max(0, t)) * 255 + 0.5) | 0) * 3;
  return [lut[k], lut[k + 1], lut[k + 2]];
}

/** Draw a horizontal colour bar of a map into a canvas. */
export function drawColorbar(canvas, lut) {
  const ctx = canvas.getContext('2d');
  const img = ctx.createImageData(256, 1);
  for (let i = 0; i < 256; i++) {
    img.data[i * 4] = lut[i * 3];
    img.data[i * 4 + 1] = lut[i * 3 + 1];
    img.data[i * 4 + 2] = lut[i * 3 + 2];
    img.data[i * 4 + 3] = 255;
  }
  canvas.width = 256;
  canvas.height = 1;
  ctx.putImageData(img, 0, 0);
}
