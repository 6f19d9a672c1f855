// Draws every <div class="chart" data-fig="…"> with plotly.min.js (served by the viewer from the plotly package).
document.querySelectorAll("div.chart[data-fig]").forEach(function (el) {
  var fig = JSON.parse(el.dataset.fig);
  Plotly.newPlot(el, fig.data, fig.layout, {displaylogo: false, responsive: true});
});
