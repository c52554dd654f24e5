// The dashboard's only script of its own. Forms marked data-confirm="question" ask before they
// submit: the Content-Security-Policy allows no inline handlers such as onsubmit.
document.addEventListener("submit", (event) => {
  const question = event.target.dataset ? event.target.dataset.confirm : undefined;
  if (question && !window.confirm(question)) {
    event.preventDefault();
  }
});
