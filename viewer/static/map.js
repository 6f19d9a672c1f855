// The embedding map, drawn by this page's own WebGL2 point renderer rather than plotly's scattergl: at 1M points
// plotly took 21 s to a first render in headless Chromium on the 2-core machine (3 s to load its bundle, the rest
// its draw in software WebGL, SwiftShader), where this page takes under 2 s (bench/results/bench_index.txt).
// The server sends two binary bodies, used as they arrive: /map/points (x, y interleaved, float32) and
// /map/colours (one uint8 code a point, looked up in a 256-entry palette texture).
// Points are opaque squares (round at 4 px), so a point whose place a later point covers exactly cannot show.
// Each frame therefore snaps every shown point to the device-pixel grid on the CPU and sends the last point of
// each pixel to gl.POINTS: the picture is the one that drawing all of them gives, with a fifth of the primitives
// at 1M points (SwiftShader's cost is per primitive: ≈ 0.6–0.8 s for 1M points at load ≈ 10 whatever their
// size, against ≈ 30 ms for the JavaScript pass). A box or lasso becomes the server's region query
// (viewer.similarity.region_sql), which stays the truth for what a region holds; a click finds the nearest shown
// point through a coarse grid over the positions (built on the first use) and opens "more like this".
(function () {
  "use strict";
  var wrap = document.getElementById("map"), cv = document.getElementById("map-gl"),
      ov = document.getElementById("map-overlay"), status = document.getElementById("map-status"),
      legend = document.getElementById("map-legend"), picker = document.getElementById("colour");
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
                 "#e6550d", "#31a354", "#756bb1", "#636363", "#bbbbbb"];
  var VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58",
                 "#b5de2b", "#fde725"];
  var NULL_COLOUR = "#bbbbbb", GRID = 256, PICK_PX = 8;
  var EVERY = /[?&]every=1/.test(location.search);   // /map?every=1 sends every point: the check that it looks the same
  var VS = "#version 300 es\n" +              // px: a device pixel's corner (or centre, for odd sizes)
    "layout(location = 0) in vec2 px;\nlayout(location = 1) in float code;\n" +
    "uniform vec2 canvas;\nuniform float size;\nuniform sampler2D palette;\nout vec4 colour;\n" +
    "void main() {\n  colour = texelFetch(palette, ivec2(int(code), 0), 0);\n" +
    "  gl_Position = vec4(px.x / canvas.x * 2.0 - 1.0, 1.0 - px.y / canvas.y * 2.0, 0.0, 1.0);\n" +
    "  gl_PointSize = size;\n}\n";
  var FS = "#version 300 es\nprecision mediump float;\nin vec4 colour;\nuniform float round;\nout vec4 o;\n" +
    "void main() {\n  if (round > 0.5 && length(gl_PointCoord - 0.5) > 0.5) discard;\n" +
    "  o = vec4(colour.rgb, 1.0);\n}\n";

  var gl = cv.getContext("webgl2", {antialias: false, premultipliedAlpha: true});
  var pts = null;                            // {head, n, xy: Float32Array(2n)}: the body's order
  var col = null;                            // {head, codes: the body's order; xy, drawCodes: the drawing order}
  var rgba = new Uint8Array(256 * 4), hidden = new Uint8Array(256), shownPx = 0;
  var key = null, last = null, outXY = null, outCodes = null;     // the frame's snapping buffers
  var view = null, W = 0, H = 0, dpr = 1, frame = 0, grid = null, shape = null, drag = null;
  var prog, uni = {}, xyBuf, codeBuf, tex;

  function rgb(hex) { return [1, 3, 5].map(function (i) { return parseInt(hex.substr(i, 2), 16); }); }

  function setup() {
    function shader(kind, src) {
      var s = gl.createShader(kind);
      gl.shaderSource(s, src);
      gl.compileShader(s);
      if (!gl.getShaderParameter(s, gl.COMPILE_STATUS)) throw new Error(gl.getShaderInfoLog(s));
      return s;
    }
    prog = gl.createProgram();
    gl.attachShader(prog, shader(gl.VERTEX_SHADER, VS));
    gl.attachShader(prog, shader(gl.FRAGMENT_SHADER, FS));
    gl.linkProgram(prog);
    if (!gl.getProgramParameter(prog, gl.LINK_STATUS)) throw new Error(gl.getProgramInfoLog(prog));
    ["canvas", "size", "palette", "round"].forEach(function (k) { uni[k] = gl.getUniformLocation(prog, k); });
    gl.bindVertexArray(gl.createVertexArray());
    xyBuf = gl.createBuffer();
    gl.bindBuffer(gl.ARRAY_BUFFER, xyBuf);
    gl.enableVertexAttribArray(0);
    gl.vertexAttribPointer(0, 2, gl.FLOAT, false, 0, 0);
    codeBuf = gl.createBuffer();
    gl.bindBuffer(gl.ARRAY_BUFFER, codeBuf);
    gl.enableVertexAttribArray(1);
    gl.vertexAttribPointer(1, 1, gl.UNSIGNED_BYTE, false, 0, 0);
    tex = gl.createTexture();
    gl.bindTexture(gl.TEXTURE_2D, tex);
    gl.texParameteri(gl.TEXTURE_2D, gl.TEXTURE_MIN_FILTER, gl.NEAREST);
    gl.texParameteri(gl.TEXTURE_2D, gl.TEXTURE_MAG_FILTER, gl.NEAREST);
  }

  // A body: uint32 header length, the JSON header (padded to 4 bytes), then the arrays (viewer.similarity._body).
  function split(buf) {
    var hlen = new DataView(buf).getUint32(0, true);
    return {head: JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 4, hlen))), at: 4 + hlen};
  }

  function fetchBody(url) {
    return fetch(url).then(function (r) {
      if (!r.ok) return r.text().then(function (t) { throw new Error(url + ": " + r.status + " " + t); });
      return r.arrayBuffer();
    });
  }

  function setPoints(buf) {
    var b = split(buf), n = b.head.n;
    pts = {head: b.head, n: n, xy: new Float32Array(buf, b.at, 2 * n)};
    key = new Int32Array(n);
    outXY = new Float32Array(2 * n);
    outCodes = new Uint8Array(n);
    grid = null;
  }

  // The drawing order: what is drawn last shows, so a category's points go most frequent first, as plotly drew
  // one trace a category, and a rare category (a near duplicate beside its kept twin) stays on top; "other"
  // goes first. A number's points keep the body's order.
  function setColours(buf) {
    var b = split(buf), n = b.head.n, xy = pts.xy, codes = new Uint8Array(buf, b.at, n), i;
    col = {head: b.head, codes: codes, xy: xy, drawCodes: codes};
    if (b.head.kind === "category") {
      var k = b.head.labels.length, other = b.head.labels[k - 1] === "other" ? k - 1 : -1;
      var rank = new Uint32Array(256), start = new Uint32Array(257);
      for (i = 0; i < k; i++) rank[i] = i === other ? 0 : i + (other >= 0 ? 1 : 0);
      for (i = 0; i < n; i++) start[rank[codes[i]] + 1]++;
      for (i = 0; i < 256; i++) start[i + 1] += start[i];
      col.xy = new Float32Array(2 * n);
      col.drawCodes = new Uint8Array(n);
      for (i = 0; i < n; i++) {
        var j = start[rank[codes[i]]]++;
        col.xy[2 * j] = xy[2 * i];
        col.xy[2 * j + 1] = xy[2 * i + 1];
        col.drawCodes[j] = codes[i];
      }
    }
    hidden.fill(0);
    palette();
    showLegend();
  }

  function colourOf(code) {
    if (col.head.kind === "category") return PALETTE[code % PALETTE.length];
    if (code === 255) return NULL_COLOUR;
    var t = code / 254 * (VIRIDIS.length - 1), i = Math.min(Math.floor(t), VIRIDIS.length - 2), f = t - i;
    var a = rgb(VIRIDIS[i]), b = rgb(VIRIDIS[i + 1]);
    return "#" + a.map(function (v, j) {
      return (256 + Math.round(v + f * (b[j] - v))).toString(16).substr(1);
    }).join("");
  }

  function palette() {
    var codes = col.head.kind === "category" ? col.head.labels.length : 256;
    rgba.fill(0);
    for (var c = 0; c < codes; c++) {
      var v = rgb(colourOf(c));
      rgba.set([v[0], v[1], v[2], 255], 4 * c);
    }
    gl.bindTexture(gl.TEXTURE_2D, tex);
    gl.texImage2D(gl.TEXTURE_2D, 0, gl.RGBA8, 256, 1, 0, gl.RGBA, gl.UNSIGNED_BYTE, rgba);
  }

  function legendRow(label, colour, codes) {
    var row = document.createElement("div"), sw = document.createElement("span");
    sw.className = "sw";
    sw.style.background = colour;
    row.appendChild(sw);
    row.appendChild(document.createTextNode(label));
    row.title = label + " — click to hide or show";
    row.addEventListener("click", function () {
      codes.forEach(function (c) { hidden[c] = 1 - hidden[c]; });
      row.classList.toggle("off", !!hidden[codes[0]]);
      redraw();
    });
    legend.appendChild(row);
  }

  function showLegend() {
    var h = col.head, title = document.createElement("b");
    legend.innerHTML = "";
    title.textContent = h.colour;
    legend.appendChild(title);
    if (h.kind === "category") {
      h.labels.forEach(function (label, k) { legendRow(label + " (" + h.counts[k] + ")", colourOf(k), [k]); });
      return;
    }
    var ramp = document.createElement("div"), ends = document.createElement("div");
    ramp.className = "ramp";
    ramp.style.background = "linear-gradient(to right, " + VIRIDIS.join(", ") + ")";
    ends.textContent = h.range[0].toPrecision(4) + " … " + h.range[1].toPrecision(4);
    legend.appendChild(ramp);
    legend.appendChild(ends);
    if (h.nulls) legendRow("no value (" + h.nulls + ")", NULL_COLOUR, [255]);
  }

  function resize() {
    dpr = window.devicePixelRatio || 1;
    W = wrap.clientWidth;
    H = wrap.clientHeight;
    [cv, ov].forEach(function (c) { c.width = Math.round(W * dpr); c.height = Math.round(H * dpr); });
    last = null;
  }

  function fit() {
    var h = pts.head, dx = (h.x[1] - h.x[0]) || 1, dy = (h.y[1] - h.y[0]) || 1;
    view = {cx: (h.x[0] + h.x[1]) / 2, cy: (h.y[0] + h.y[1]) / 2, sx: 0.94 * W / dx, sy: 0.94 * H / dy};
  }

  // CSS pixels within the map <-> the layout's coordinates.
  function toScreen(x, y) { return [W / 2 + (x - view.cx) * view.sx, H / 2 - (y - view.cy) * view.sy]; }
  function toData(px, py) { return [view.cx + (px - W / 2) / view.sx, view.cy - (py - H / 2) / view.sy]; }

  // Every shown point's place on the device-pixel grid; then the last point (in drawing order) of each place,
  // packed for gl.POINTS. A point of an even size is centred on a pixel corner and one of an odd size on a pixel
  // centre, so two points of one place cover the same pixels exactly and the later one hides the earlier.
  function snap(size) {
    var n = pts.n, w = cv.width, h = cv.height, r = Math.ceil(size / 2), gw = w + 2 * r, gh = h + 2 * r;
    var kx = view.sx * dpr, ky = view.sy * dpr, half = size % 2 ? 0.5 : 0;
    var ox = w / 2 - view.cx * kx - half, oy = h / 2 + view.cy * ky - half;
    var xy = col.xy, codes = col.drawCodes, j, m = 0;
    if (!last || last.length !== gw * gh) last = new Int32Array(gw * gh);
    last.fill(-1);
    for (j = 0; j < n; j++) {
      var px = Math.round(ox + xy[2 * j] * kx) + r, py = Math.round(oy - xy[2 * j + 1] * ky) + r;
      if (hidden[codes[j]] || !(px >= 0 && px < gw && py >= 0 && py < gh)) { key[j] = -1; continue; }
      key[j] = py * gw + px;
      last[key[j]] = j;
    }
    for (j = 0; j < n; j++) {
      if (key[j] < 0 || (last[key[j]] !== j && !EVERY)) continue;
      outXY[2 * m] = key[j] % gw - r + half;
      outXY[2 * m + 1] = Math.floor(key[j] / gw) - r + half;
      outCodes[m++] = codes[j];
    }
    return m;
  }

  function draw() {
    frame = 0;
    var size = Math.max(1, Math.round((pts.n > 200000 ? 2 : 4) * dpr));
    shownPx = window.ovpipeMap.primitives = snap(size);
    gl.bindBuffer(gl.ARRAY_BUFFER, xyBuf);
    gl.bufferData(gl.ARRAY_BUFFER, outXY.subarray(0, 2 * shownPx), gl.DYNAMIC_DRAW);
    gl.bindBuffer(gl.ARRAY_BUFFER, codeBuf);
    gl.bufferData(gl.ARRAY_BUFFER, outCodes.subarray(0, shownPx), gl.DYNAMIC_DRAW);
    gl.viewport(0, 0, cv.width, cv.height);
    gl.clearColor(0, 0, 0, 0);
    gl.clear(gl.COLOR_BUFFER_BIT);
    gl.useProgram(prog);
    gl.uniform2f(uni.canvas, cv.width, cv.height);
    gl.uniform1f(uni.size, size);
    gl.uniform1f(uni.round, size > 3 ? 1 : 0);
    gl.uniform1i(uni.palette, 0);
    gl.drawArrays(gl.POINTS, 0, shownPx);
    outline();
  }

  function redraw() { if (!frame) frame = requestAnimationFrame(draw); }

  // Draws, then reads one pixel back: that waits for the GPU process to finish the draw, so "ready" means drawn.
  function drawNow(t0) {
    draw();
    gl.readPixels(0, 0, 1, 1, gl.RGBA, gl.UNSIGNED_BYTE, new Uint8Array(4));
    status.textContent = pts.n + " points drawn in " + Math.round(performance.now() - t0) + " ms (" + shownPx +
      " distinct pixels)";
    window.ovpipeMap.drawn = pts.n;
    window.mapReady = true;
  }

  function outline() {
    var c = ov.getContext("2d"), path = null;
    c.setTransform(dpr, 0, 0, dpr, 0, 0);
    c.clearRect(0, 0, W, H);
    if (drag && drag.moved && drag.mode !== "pan") {
      path = drag.mode === "box" ? corners(drag.start, drag.last) : drag.path;
    } else if (shape) {
      path = shape.map(function (p) { return toScreen(p[0], p[1]); });
    }
    if (!path) return;
    c.beginPath();
    path.forEach(function (p, i) { if (i) c.lineTo(p[0], p[1]); else c.moveTo(p[0], p[1]); });
    c.closePath();
    c.fillStyle = "rgba(36, 50, 63, 0.08)";
    c.strokeStyle = "#24323f";
    c.setLineDash([4, 3]);
    c.fill();
    c.stroke();
  }

  function corners(a, b) { return [a, [b[0], a[1]], b, [a[0], b[1]]]; }

  function num(v) { return String(+v.toPrecision(9)); }

  function select(mode, screen) {
    shape = screen.map(function (p) { return toData(p[0], p[1]); });
    outline();
    if (mode === "box") {
      var a = shape[0], b = shape[2];
      showRegion("box=" + [Math.min(a[0], b[0]), Math.max(a[0], b[0]), Math.min(a[1], b[1]), Math.max(a[1], b[1])]
        .map(num).join(","));
    } else {
      var step = Math.max(1, Math.ceil(shape.length / 256)), out = [];      // region_sql keeps 256 vertices
      for (var i = 0; i < shape.length; i += step) out.push(num(shape[i][0]) + "," + num(shape[i][1]));
      showRegion("lasso=" + encodeURIComponent(out.join(";")));
    }
  }

  function showRegion(query) {
    document.getElementById("region-count").textContent = "Selecting…";
    fetch("/map/region?" + query).then(function (r) { return r.json(); }).then(function (got) {
      var grid = document.getElementById("region-grid"), link = document.getElementById("region-sql-link");
      if (got.error) { document.getElementById("region-count").textContent = got.error; return; }
      document.getElementById("region-count").textContent =
        got.total + " images in the region (first " + got.rows.length + " below).";
      document.getElementById("region-sql").textContent = got.sql;
      link.href = "/sql?q=" + encodeURIComponent(got.sql);
      link.hidden = false;
      grid.innerHTML = "";
      got.rows.forEach(function (r) {
        var card = document.createElement("div"), a = document.createElement("a"), img = document.createElement("img");
        card.className = "card"; a.href = "/samples/" + r.sample_id;
        img.loading = "lazy"; img.src = "/thumb/" + r.sample_id + "/0?px=160"; img.alt = r.sample_id;
        a.appendChild(img); card.appendChild(a);
        card.appendChild(document.createElement("br"));
        card.appendChild(document.createTextNode(r.source + " · " + r.status));
        grid.appendChild(card);
      });
    });
  }

  // Every point's cell of a GRID × GRID grid over the layout's bounds, as a counting sort: start[c] .. start[c+1]
  // index `order`, the points of cell c (1M points: ≈ 50 ms, once).
  function buildGrid() {
    var h = pts.head, n = pts.n, xy = pts.xy;
    var gx = GRID / ((h.x[1] - h.x[0]) || 1), gy = GRID / ((h.y[1] - h.y[0]) || 1);
    var cell = new Uint32Array(n), start = new Uint32Array(GRID * GRID + 1), order = new Uint32Array(n), i;
    for (i = 0; i < n; i++) {
      var cx = Math.min(GRID - 1, Math.max(0, Math.floor((xy[2 * i] - h.x[0]) * gx))) || 0;
      var cy = Math.min(GRID - 1, Math.max(0, Math.floor((xy[2 * i + 1] - h.y[0]) * gy))) || 0;
      cell[i] = cy * GRID + cx;
      start[cell[i] + 1]++;
    }
    for (i = 0; i < GRID * GRID; i++) start[i + 1] += start[i];
    var fill = start.slice(0, GRID * GRID);
    for (i = 0; i < n; i++) order[fill[cell[i]]++] = i;
    grid = {gx: gx, gy: gy, start: start, order: order};
  }

  function pick(px, py) {
    if (!grid) buildGrid();
    var h = pts.head, lo = toData(px - PICK_PX, py + PICK_PX), hi = toData(px + PICK_PX, py - PICK_PX);
    function cellOf(v, v0, g) { return Math.min(GRID - 1, Math.max(0, Math.floor((v - v0) * g))); }
    var x0 = cellOf(lo[0], h.x[0], grid.gx), x1 = cellOf(hi[0], h.x[0], grid.gx);
    var y0 = cellOf(lo[1], h.y[0], grid.gy), y1 = cellOf(hi[1], h.y[0], grid.gy), best = -1, bd = PICK_PX * PICK_PX;
    for (var cy = y0; cy <= y1; cy++) {
      for (var cx = x0; cx <= x1; cx++) {
        var c = cy * GRID + cx;
        for (var j = grid.start[c]; j < grid.start[c + 1]; j++) {
          var i = grid.order[j];
          if (hidden[col.codes[i]]) continue;
          var s = toScreen(pts.xy[2 * i], pts.xy[2 * i + 1]), d = (s[0] - px) * (s[0] - px) + (s[1] - py) * (s[1] - py);
          if (d <= bd) { bd = d; best = i; }
        }
      }
    }
    return best;
  }

  function local(e) { var r = ov.getBoundingClientRect(); return [e.clientX - r.left, e.clientY - r.top]; }

  function mode() { return document.querySelector("input[name=drag]:checked").value; }

  ov.addEventListener("pointerdown", function (e) {
    if (!view || e.button !== 0) return;
    ov.setPointerCapture(e.pointerId);
    var p = local(e);
    drag = {mode: mode(), start: p, last: p, path: [p], moved: false, cx: view.cx, cy: view.cy};
  });
  // The point under the pointer names its colour in the tooltip (at most once a frame).
  var hoverAt = null;
  function hover() {
    var i = pick(hoverAt[0], hoverAt[1]), h = col.head, c = i < 0 ? -1 : col.codes[i];
    hoverAt = null;
    if (c < 0) { ov.title = ""; return; }
    ov.title = h.colour + ": " + (h.kind === "category" ? h.labels[c] : c === 255 ? "no value" :
      "≈ " + (h.range[0] + c / 254 * (h.range[1] - h.range[0])).toPrecision(4));
  }

  ov.addEventListener("pointermove", function (e) {
    if (!drag) {
      if (col && !hoverAt) requestAnimationFrame(hover);
      hoverAt = local(e);
      return;
    }
    var p = local(e);
    drag.moved = drag.moved || Math.abs(p[0] - drag.start[0]) + Math.abs(p[1] - drag.start[1]) > 4;
    if (drag.mode === "pan") {
      view.cx = drag.cx - (p[0] - drag.start[0]) / view.sx;
      view.cy = drag.cy + (p[1] - drag.start[1]) / view.sy;
      redraw();
    } else {
      var q = drag.path[drag.path.length - 1];
      if (Math.abs(p[0] - q[0]) + Math.abs(p[1] - q[1]) > 2) drag.path.push(p);
      drag.last = p;
      outline();
    }
  });
  ov.addEventListener("pointerup", function (e) {
    if (!drag) return;
    var d = drag;
    drag = null;
    d.last = local(e);
    if (!d.moved) {
      var i = pick(d.start[0], d.start[1]);
      if (i >= 0) window.location = "/map/point/" + i;        // the server resolves the i-th point's sample
    } else if (d.mode === "box") {
      select("box", corners(d.start, d.last));
    } else if (d.mode === "lasso" && d.path.length >= 3) {
      select("lasso", d.path);
    }
    outline();
  });
  ov.addEventListener("wheel", function (e) {
    if (!view) return;
    e.preventDefault();
    var p = local(e), at = toData(p[0], p[1]), f = Math.exp(-e.deltaY * 0.002);
    view.sx *= f;
    view.sy *= f;
    view.cx = at[0] - (p[0] - W / 2) / view.sx;
    view.cy = at[1] + (p[1] - H / 2) / view.sy;
    redraw();
  }, {passive: false});
  function showAll() { if (view) { fit(); redraw(); } }
  ov.addEventListener("dblclick", showAll);
  document.getElementById("map-reset").addEventListener("click", showAll);
  window.addEventListener("resize", function () { if (view) { resize(); fit(); redraw(); } });

  window.ovpipeMap = {drawn: 0, toScreen: function (x, y) {       // viewport pixels of a layout place
    var r = ov.getBoundingClientRect(), s = toScreen(x, y);
    return [r.left + s[0], r.top + s[1]];
  }};

  if (!gl) {
    status.textContent = "this browser offers no WebGL2: the map cannot be drawn";
    return;
  }
  setup();
  Promise.all([fetchBody("/map/points"), fetchBody("/map/colours?colour=" + encodeURIComponent(picker.value))])
    .then(function (got) {
      setPoints(got[0]);
      setColours(got[1]);
      resize();
      fit();
      drawNow(0);                         // performance.now() counts from the navigation
    }).catch(function (e) { status.textContent = String(e); throw e; });
  picker.addEventListener("change", function () {
    var t = performance.now();
    window.mapReady = false;
    status.textContent = "loading…";
    fetchBody("/map/colours?colour=" + encodeURIComponent(picker.value)).then(function (buf) {
      setColours(buf);
      drawNow(t);
    });
  });
})();
