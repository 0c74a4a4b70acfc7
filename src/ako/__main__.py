from ako.cli import console

console()
