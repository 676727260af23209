// Live ladder: while the campaign runs, fetch the ladder fragment every few seconds and swap it
// in when it changed (no manual refresh). Stops once the fragment says the campaign ended.
(function () {
  const box = document.getElementById("ladder");
  if (!box) return;
  const src = box.dataset.src, every = parseInt(box.dataset.pollMs || "2000", 10);
  const live = () => { const l = box.querySelector(".ladder"); return l && l.dataset.live === "1"; };
  async function tick() {
    try {
      const r = await fetch(src, {cache: "no-store"});
      if (r.ok) {
        const html = await r.text();
        if (html !== box.dataset.last) { box.innerHTML = html; box.dataset.last = html; }
      }
    } catch (e) { /* the server restarting: try again next tick */ }
    if (live()) setTimeout(tick, every);
  }
  if (live()) setTimeout(tick, every);
})();
