// The ε slider of the duplicate groups page: fades the members whose marked cosine is not above 1 − ε (kept at
// that ε) and counts, from the binned cosines of every marked row, how many a cut at that ε removes.
(function () {
  var slider = document.getElementById("eps"), groups = document.getElementById("groups");
  if (!slider || !groups) return;
  var hist = JSON.parse(groups.dataset.hist), lowest = parseFloat(groups.dataset.lowest);
  function update() {
    var eps = parseFloat(slider.value), cut = 1 - eps, removed = 0;
    Object.keys(hist).forEach(function (b) {
      if (lowest + (parseInt(b, 10) / 200) * (1 - lowest) >= cut - 1e-12) removed += hist[b];
    });
    document.getElementById("eps-value").textContent = "ε = " + eps.toFixed(5);
    document.getElementById("eps-removed").textContent = "about " + removed;
    groups.querySelectorAll(".member").forEach(function (m) {
      m.style.opacity = parseFloat(m.dataset.cos) > cut ? 1 : 0.3;
    });
  }
  slider.addEventListener("input", update);
  update();
})();
