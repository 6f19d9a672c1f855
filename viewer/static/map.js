// The embedding map: every drawn point as one WebGL scatter (plotly's scattergl), from the server's binary body
// (viewer.similarity.map_points: header, x, y, index position, colour). A box or lasso selection asks the
// server for the region's samples and shows the filter as SQL; a click opens "more like this".
(function () {
  var el = document.getElementById("map"), status = document.getElementById("map-status");
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
                 "#e6550d", "#31a354", "#756bb1", "#636363", "#bbbbbb"];
  var positions = [];   // per trace: the index position of each of its points

  function parse(buf) {
    var hlen = new DataView(buf).getUint32(0, true);
    var head = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 4, hlen)));
    var n = head.n, at = 4 + hlen;
    var x = new Float32Array(buf, at, n), y = new Float32Array(buf, at + 4 * n, n);
    var pos = new Uint32Array(buf, at + 8 * n, n);
    var v = head.kind === "category" ? new Uint16Array(buf, at + 12 * n, n) : new Float32Array(buf, at + 12 * n, n);
    return {head: head, x: x, y: y, pos: pos, v: v};
  }

  function traces(d) {
    var n = d.head.n, marker = {size: n > 200000 ? 2 : 4, opacity: 0.7};
    if (d.head.kind !== "category") {
      positions = [d.pos];
      return [{type: "scattergl", mode: "markers", x: d.x, y: d.y, hoverinfo: "none", name: d.head.colour,
               marker: Object.assign({color: d.v, colorscale: "Viridis", cmin: d.head.range[0],
                                      cmax: d.head.range[1], showscale: true}, marker)}];
    }
    var k = d.head.labels.length, count = new Uint32Array(k + 1), i;
    for (i = 0; i < n; i++) count[d.v[i]]++;
    var xs = [], ys = [], ps = [], fill = new Uint32Array(k + 1);
    for (i = 0; i <= k; i++) {
      xs.push(new Float32Array(count[i])); ys.push(new Float32Array(count[i])); ps.push(new Uint32Array(count[i]));
    }
    for (i = 0; i < n; i++) {
      var c = d.v[i], j = fill[c]++;
      xs[c][j] = d.x[i]; ys[c][j] = d.y[i]; ps[c][j] = d.pos[i];
    }
    positions = ps;
    var out = [];
    for (i = 0; i <= k; i++) {
      out.push({type: "scattergl", mode: "markers", x: xs[i], y: ys[i], hoverinfo: "name",
                name: i < k ? d.head.labels[i] + " (" + count[i] + ")" : "", showlegend: i < k,
                marker: Object.assign({color: PALETTE[i % PALETTE.length]}, marker)});
    }
    return out;
  }

  function showRegion(query) {
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

  function draw(colour) {
    var t0 = performance.now();
    status.textContent = "loading…";
    return fetch("/map/points?colour=" + encodeURIComponent(colour)).then(function (r) {
      if (!r.ok) throw new Error("map points: " + r.status);
      return r.arrayBuffer();
    }).then(function (buf) {
      var d = parse(buf);
      var layout = {dragmode: "select", hovermode: "closest", margin: {l: 20, r: 20, t: 10, b: 20},
                    xaxis: {showticklabels: false, zeroline: false}, yaxis: {showticklabels: false, zeroline: false},
                    legend: {itemsizing: "constant"}, uirevision: "map"};
      return Plotly.react(el, traces(d), layout, {displaylogo: false, responsive: true}).then(function () {
        status.textContent = d.head.n + " points, drawn in " + Math.round(performance.now() - t0) + " ms";
        window.mapReady = true;
      });
    });
  }

  draw(document.getElementById("colour").value).then(function () {
    el.on("plotly_selected", function (ev) {
      if (!ev) return;
      if (ev.range) {
        showRegion("box=" + [ev.range.x[0], ev.range.x[1], ev.range.y[0], ev.range.y[1]].join(","));
      } else if (ev.lassoPoints) {
        var p = ev.lassoPoints, pts = [];
        for (var i = 0; i < p.x.length; i++) pts.push(p.x[i] + "," + p.y[i]);
        showRegion("lasso=" + encodeURIComponent(pts.join(";")));
      }
    });
    el.on("plotly_click", function (ev) {
      var pt = ev.points && ev.points[0];
      if (pt && positions[pt.curveNumber]) window.location = "/map/point/" + positions[pt.curveNumber][pt.pointIndex];
    });
  });
  document.getElementById("colour").addEventListener("change", function (e) {
    window.mapReady = false;
    draw(e.target.value);
  });
})();
